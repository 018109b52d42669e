"""The protocol of every study kind, as data: what each optimizer name means, each variant's --set list, the
figures a table row gives beyond top-1, and the papers' claims with their verdict rules. `kinds.KINDS` puts them
together with the code that reads them; nothing here runs.

Batches are Fashion-MNIST's (60,000 images): x 1,281,167 / 60,000 is the ImageNet batch with the same steps per
epoch (384 ~ 8K, 1,536 ~ 32K, 3,072 ~ 64K).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# batch-scaling: what each optimizer name means (on top of the recipe; --opt-set OPT:KEY=VALUE overrides a key).
OPTIMIZERS: dict[str, dict[str, object]] = {
    "sgd": {"optim.name": "sgd", "optim.scaling_rule": "linear", "schedule.warmup_start_lr": None},
    "lars": {"optim.name": "lars", "optim.scaling_rule": "linear", "optim.lr": 2.0,
             "optim.trust_coefficient": 0.001, "schedule.warmup_start_lr": 0.0},
    "lamb": {"optim.name": "lamb", "optim.scaling_rule": "sqrt", "optim.lr": 0.004,
             "optim.weight_decay": 0.01, "schedule.warmup_start_lr": 0.0},
}

# The variant kinds: each variant's own --set items, formatted with the kind's flags (and `base_epochs`, the
# ensemble's epochs before its cycles); they follow the recipe, --set and the cells' common keys.
VARIANTS: dict[str, dict[str, tuple[str, ...]]] = {
    "batch-control": {
        "fixed": ("schedule.epochs={epochs:g}", "batch.global_batch={batch}", "batch.phases=[]"),
        "control": ("schedule.epochs={epochs:g}", "batch.global_batch={batch}",
                    "batch.phases=[{{start_epoch: 0, global_batch: {start_batch}}}, "
                    "{{start_epoch: {switch_epochs:g}, global_batch: {batch}}}]"),
    },
    "ensemble": {
        "single": ("schedule.epochs={epochs:g}", "batch.global_batch={batch}", "batch.phases=[]", "ensemble.cycles=0"),
        "ensemble": ("schedule.epochs={base_epochs:g}", "batch.global_batch={batch}", "batch.phases=[]",
                     "ensemble.cycles={cycles}", "ensemble.cycle_epochs={cycle_epochs:g}",
                     "ensemble.collapse_epochs={collapse_epochs:g}"),
    },
}


@dataclass(frozen=True)
class Figure:
    """A figure a table row gives beyond top-1, from each finished cell's `cell` key: `NAME_mean` over the seeds
    that have it (None without any), or with `spread` `NAME_mean` and `NAME_std` where every seed has it. Only
    `variant`'s rows where given; `column`, `row` and `bar` are how the variant table and chart show it."""
    name: str
    cell: str
    spread: bool = False
    variant: str | None = None
    column: str = ""
    row: str = ""
    bar: str = ""


FIGURES: dict[str, tuple[Figure, ...]] = {
    "batch-scaling": (Figure("train_loss", "train_loss"), Figure("noise_scale", "noise_scale")),
    "batch-control": (),
    "ensemble": (Figure("best_snapshot", "best_snapshot_top1", spread=True, variant="ensemble",
                        column="best snapshot (%)", bar="best snapshot"),
                 Figure("swa", "swa_top1", spread=True, variant="ensemble",
                        row="weight average of the snapshots (SWA, BN recomputed)", bar="SWA")),
}

# A variant whose top-1 is another key of its cells: the ensemble's own (the softmax average of its snapshots).
TOP1: dict[str, dict[str, str]] = {"ensemble": {"ensemble": "ensemble_top1"}}


@dataclass(frozen=True)
class Rule:
    """A claim's verdict rule (`verdict.holds`): `difference OP points / 100`, plus the seeds' spread (the larger
    standard deviation of the two rows) where `beyond_spread`. OP: ">=" (at least), ">" (above), "<" (below)."""
    op: str
    points: float
    beyond_spread: bool = False


@dataclass(frozen=True)
class Also:
    """A further rule on the claim's own row: its top-1 against its figure `figure` (`FIGURES`), recorded as
    `name` and said as `label`."""
    name: str
    label: str
    figure: str
    rule: Rule


@dataclass(frozen=True)
class Claim:
    """A paper's claim: the row it reads (`cell`: its group's fields), measured against `against`'s row (None:
    the kind's baseline, `BASELINE`), held where `rule` and every `also` hold."""
    claim: str
    cell: dict[str, object]
    rule: Rule
    against: dict[str, object] | None = None
    who: str = ""
    also: tuple[Also, ...] = field(default_factory=tuple)


WITHIN_1 = Rule(">=", -1.0)   # within 1.0 point of the baseline
CLAIMS: dict[str, tuple[Claim, ...]] = {
    "batch-scaling": (
        Claim("SGD at ImageNet 8K within 1.0 point of the small-batch baseline", {"batch": 384, "optimizer": "sgd"},
              WITHIN_1, who="Goyal et al."),
        Claim("SGD breaks at ImageNet 64K: more than 1.0 point below", {"batch": 3072, "optimizer": "sgd"},
              Rule("<", -1.0), who="Goyal et al."),
        Claim("LARS at ImageNet 32K within 1.0 point of the small-batch baseline", {"batch": 1536, "optimizer": "lars"},
              WITHIN_1, who="You et al."),
        Claim("LAMB at ImageNet 32K within 1.0 point of the small-batch baseline", {"batch": 1536, "optimizer": "lamb"},
              WITHIN_1, who="You et al. (LAMB)"),
    ),
    "batch-control": (
        Claim("control above fixed beyond the seeds' spread", {"variant": "control"},
              Rule(">", 0.0, beyond_spread=True), against={"variant": "fixed"}),
    ),
    "ensemble": (
        Claim("ensemble >= single model and >= best snapshot + 0.3", {"variant": "ensemble"}, Rule(">=", 0.0),
              against={"variant": "single"},
              also=(Also("gain_over_best_snapshot", "gain over the best snapshot", "best_snapshot", Rule(">=", 0.3)),)),
    ),
}

# batch-scaling's claims are measured against this optimizer at the smallest batch that ran; a claim at that
# batch is not judged (it has no smaller batch to be measured against).
BASELINE: dict[str, object] = {"optimizer": "sgd"}
