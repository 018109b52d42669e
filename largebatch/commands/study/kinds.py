"""The study kinds, one table: what each kind's flags are, how they become groups of cells (`plan.py`), how its table
is shaped and shown, and which claims it judges (`protocol.py`). The runner (`runner.py`) knows no kind.

- batch-scaling: top-1 against global batch per optimizer at a fixed epoch budget, the shape of Goyal et al.'s
  error-vs-minibatch figure and You et al.'s LARS tables. Every cell trains the same recipe for the same --epochs;
  a batch whose per-worker share exceeds --micro-batch accumulates. "sgd" is Goyal's recipe (momentum SGD, linear
  scaling rule, gradual warm-up from the unscaled lr); "lars" and "lamb" take their settings in the protocol
  (`protocol.yaml`), which --opt-set OPT:section.key=value overrides. The claims: each against SGD at the smallest batch.
- batch-control (Sony, Mikami et al.): `fixed` trains at --batch for the whole budget; `control` trains at
  --start-batch for --switch-epochs, then at --batch. The claim: control is above fixed, beyond the seeds' spread.
- ensemble (Codreanu et al.): `single` trains one model for --epochs; `ensemble` spends the same --epochs as a
  base schedule plus --cycles cycles of --cycle-epochs, each ending in a collapse and a snapshot, and is
  evaluated as the softmax average of its snapshots. The claims: the ensemble at least 0.3 points above its
  best snapshot, and at least equal to the single model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from largebatch.cli import ArgumentParser
from largebatch.commands.study import plan, protocol, tables
from largebatch.commands.study.protocol import Figure, Protocol


@dataclass(frozen=True)
class Kind:
    name: str
    about: str                               # the command's description
    flags: tuple[tuple[str, dict[str, Any]], ...]   # its own flags, after the common ones
    epochs: float | None                     # --epochs' default (None: the recipe's)
    seeds: int                               # --seeds' default
    grid_per: str | None                     # --lr-grid OPT:LR,... per this group field (repeatable, and so is
                                             # --from-tuning); None: --lr-grid LR,... for every variant
    layout: Callable[[Any, Any], plan.Layout]   # its groups from its flags
    axes: tuple[str, ...]                    # the fields that name a group in study.json's cells and table
    every_lr: bool                           # table: a row per group and lr (else the chosen row per group)
    row_key: str                             # a table row's key, from its fields
    row_word: str                            # a tuning table's row in a sentence
    top1: dict[str, str]                     # a variant whose top-1 is another cell key
    figures: tuple[Figure, ...]              # a row's figures beyond top-1
    protocol: Protocol                       # its optimizers or variants and its claims (a study's --protocol:
                                             # the runner's copy of the kind carries that one)
    claims_listed: bool                      # the verdicts beside the table (study.json "claims"), else in it
    settings: tuple[str, ...]                # study_settings.json: the flags a resumed study repeats
    meta: tuple[str, ...]                    # study.json's head ("settings": those)
    header: str                              # study.md's line under the command
    body: Callable[..., str]                 # study.md's tables
    chart: Callable[..., None]               # study.png


_SCALING_FLAGS = (
    ("--batches", dict(default="256,1024,4096,8192,16384", help="comma-separated global batches")),
    ("--optimizers", dict(default="sgd,lars,lamb", help=f"comma-separated, of the protocol's "
                                                                 f"({', '.join(protocol.default('batch-scaling').optimizers)} "
                                                                 "in the package's)")),
    ("--opt-set", dict(action="append", default=[], metavar="OPT:SECTION.KEY=VALUE",
                       help="override a key for one optimizer's cells, e.g. lars:optim.lr=4")),
    ("--claims-only", dict(action="store_true",
                           help="run only the cells the papers' claims read: SGD at the smallest batch (the baseline) "
                                "and each claim's cell, of those in --batches and --optimizers")),
)
_CONTROL_FLAGS = (
    ("--batch", dict(type=int, default=3072, help="the large global batch (ImageNet ~64K on 60,000 images)")),
    ("--start-batch", dict(type=int, default=384, help="the control variant's batch before the switch")),
    ("--switch-epochs", dict(type=float, default=6.0, help="epochs at --start-batch before --batch")),
)
_ENSEMBLE_FLAGS = (
    ("--batch", dict(type=int, default=384, help="global batch of both variants")),
    ("--cycles", dict(type=int, default=2, help="cycles after the base schedule")),
    ("--cycle-epochs", dict(type=float, default=4.0, help="epochs of one cycle")),
    ("--collapse-epochs", dict(type=float, default=1.0, help="collapse at the end of each segment")),
    ("--own-schedule", dict(action="store_true",
                            help="the ensemble variant is the recipe's own ensemble.segments schedule (its base run, "
                                 "segments and collapses, e.g. the authors' released one), scaled to --epochs; "
                                 "--cycles, --cycle-epochs and --collapse-epochs do not apply")),
)
_VARIANT_SETTINGS = ("recipe", "epochs", "seeds", "nproc_per_node", "micro_batch", "val_split", "overrides", "lr_grid",
                     "from_tuning", "protocol")
_VARIANT_KIND = dict(epochs=24.0, seeds=3, grid_per=None, layout=plan.variant_layout, axes=("variant",), every_lr=False,
                     row_key="{variant}", row_word="for variant", claims_listed=False,
                     meta=("command", "kind", "settings", "machine", "split"),
                     header="{Machines}; machine time of the finished cells: {machine_time}",
                     body=tables.variant_body, chart=tables.variant_chart)


def _about(kind: str) -> str:
    """The kind's bullet of this module's docstring, as one line."""
    return " ".join(next(b for b in (__doc__ or "").split("\n- ") if b.startswith(kind)).split())


KINDS: dict[str, Kind] = {
    "batch-scaling": Kind(
        "batch-scaling", _about("batch-scaling"), _SCALING_FLAGS, epochs=None, seeds=1, grid_per="optimizer",
        layout=plan.scaling_layout,
        axes=("batch", "optimizer"), every_lr=True, row_key="{optimizer}@{batch}", row_word="in its table row",
        top1={}, figures=protocol.FIGURES["batch-scaling"], protocol=protocol.default("batch-scaling"),
        claims_listed=True,
        settings=("recipe", "epochs", "nproc_per_node", "micro_batch", "overrides", "opt_set", "lr_grid", "val_split",
                  "from_tuning", "protocol"),
        meta=("command", "settings", "seeds", "batches", "optimizers", "claims_only", "train_size", "machine"),
        header="Epochs per cell: {epochs}, seeds: {seeds}, workers per cell: {nproc_per_node}, evaluated on the "
               "{split} set, {machines}, machine time of the finished cells: {machine_time}",
        body=tables.grid_body, chart=tables.batch_chart),
    "batch-control": Kind(
        "batch-control", _about("batch-control"), _CONTROL_FLAGS, top1={}, figures=protocol.FIGURES["batch-control"],
        protocol=protocol.default("batch-control"),
        settings=(*_VARIANT_SETTINGS, "batch", "start_batch", "switch_epochs"),
        **_VARIANT_KIND),   # type: ignore[arg-type]
    "ensemble": Kind(
        "ensemble", _about("ensemble"), _ENSEMBLE_FLAGS, top1=protocol.TOP1["ensemble"],
        figures=protocol.FIGURES["ensemble"], protocol=protocol.default("ensemble"),
        settings=(*_VARIANT_SETTINGS, "batch", "cycles", "cycle_epochs", "collapse_epochs", "own_schedule"),
        **_VARIANT_KIND),   # type: ignore[arg-type]
}


def of_args(name: str, args) -> Kind:
    """The kind as a study's flags give it: with its --protocol in place of the package's."""
    kind = KINDS[name]
    own = protocol.of_args(name, args)
    return kind if own is kind.protocol else dataclasses.replace(kind, protocol=own)


def parser(name: str) -> ArgumentParser:
    """`largebatch study NAME`'s flags: the common ones, as the kind sets them, then its own."""
    kind = KINDS[name]
    p = ArgumentParser(prog=f"largebatch study {name}", description=kind.about)
    p.add_argument("--recipe", default="fashion_mnist", help="recipe every cell starts from")
    p.add_argument("--epochs", type=float, default=kind.epochs,
                   help="epoch budget of every cell" + (" (default: the recipe's)" if kind.epochs is None else ""))
    p.add_argument("--seeds", type=int, default=kind.seeds, help="seeds of every cell (0..N-1)")
    p.add_argument("--out", type=Path, default=Path(f"runs/study-{name}"), help="study directory")
    p.add_argument("--nproc-per-node", type=int, default=2, help="workers per cell")
    p.add_argument("--micro-batch", type=int, default=512,
                   help="largest per-worker forward batch (accumulation above it)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe key in every cell (repeatable)")
    p.add_argument("--protocol", default=None, metavar="FILE_OR_MAPPING",
                   help=f"replace keys of the package's protocol ({', '.join(protocol.KEYS[name])}: claims and "
                        "baseline whole, optimizers setting by setting, variants by name; "
                        "largebatch/commands/study/protocol.yaml): a YAML file, or a mapping inline ('{...}')")
    p.add_argument("--val-split", type=int, default=None,
                   help="tune: hold out this many training images and evaluate every cell on them (data.val_split)")
    if kind.grid_per is None:
        p.add_argument("--lr-grid", default=None, metavar="A,B,...",
                       help="tune: the optim.lr values every variant runs at (with --val-split)")
        p.add_argument("--from-tuning", type=Path, default=None, metavar="TUNING_OUT",
                       help="final: each variant at the lr the tuning study in this directory chose, on the test set")
    else:
        p.add_argument("--lr-grid", action="append", default=[], metavar="OPT:LR,LR,...",
                       help=f"tune: the optim.lr values to try for one {kind.grid_per} (repeatable), e.g. lars:1,2,4")
        p.add_argument("--from-tuning", type=Path, action="append", default=[], metavar="TUNING_OUT",
                       help="final: each batch x optimizer's lr chosen by the tuning study in this directory "
                            "(repeatable: the best over studies of one protocol)")
    for flag, options in kind.flags:
        p.add_argument(flag, **options)
    p.add_argument("--dry-run", action="store_true", help="check and list the cells, train nothing")
    return p
