"""Steps 1-2 of a study: its cells, and every one checked before any trains.

1. Groups: the cells of a group differ only in lr and seed. A batch-scaling group is a (global batch, optimizer)
   of --batches x --optimizers (with --claims-only those the claims read, `claim_cells`); a variant kind's
   group is one of its variants (the protocol's `variants`, or with --own-schedule the recipe's own schedule). Each
   group knows its cells' `largebatch train --set` list.
2. Learning rates: a tuning study runs every lr of its --lr-grid (per optimizer, OPT:LR,..., for batch-scaling;
   one list for every variant otherwise); a final study the lr its --from-tuning studies chose for the group
   (`tuning.chosen_lrs_of`); without either, the recipe's (None).
3. Cells: (group, lr, seed), seeds outermost so that a stopped study has whole seeds done; each in its own run
   directory OUT/runs/SLUG[-lrLR]-sSEED.
4. Every group's plan resolves (divisibility, batch against the dataset's size) before anything trains
   (`check_cells`).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

from largebatch.cli import check_numbers
from largebatch.commands.study import protocol
from largebatch.commands.study.protocol import Claim
from largebatch.errors import UserError


@dataclass(frozen=True)
class Group:
    """The cells that differ only in lr and seed: `fields` name them in study.json (batch and optimizer, or
    variant), `slug` their run directories, `label` the console's lines, `what` a sentence; `grid_key` is their
    --lr-grid entry ("*": the one list); `sets(lr, seed)` is a cell's --set list."""
    fields: dict[str, Any]
    slug: str
    label: str
    what: str
    grid_key: str
    sets: Callable[[float | None, int], list[str]]

    @property
    def key(self) -> tuple:
        return tuple(self.fields.values())


@dataclass(frozen=True)
class Layout:
    """A study's groups from its flags; `grid_names`: the names --lr-grid OPT:LR,... may give (None: one list,
    --lr-grid LR,...); `facts`: what study.json records of them beyond the flags; `noun`: a group in words."""
    groups: list[Group]
    grid_names: list[str] | None = None
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    noun: str = "variant"


def parse_list(text: str, what: str, cast, example: str = "256,1024") -> list:
    try:
        items = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--{what} {text!r} is not a comma-separated list; e.g. --{what} {example}.") from None
    if not items:
        raise UserError(f"--{what} is empty; give at least one value.")
    return items


def lr_grid(value: list[str] | str | None, names: list[str] | None) -> dict[str, list[float]]:
    """--lr-grid as {grid_key: [lr, ...]}: with `names`, items OPT:V1,V2 (repeatable) per name; without, one list
    A,B,... for every group ("*"). Every lr a positive number."""
    if not value:
        if isinstance(value, str):   # --lr-grid "": refused, not taken as no grid
            parse_list(value, "lr-grid", float)
        return {}
    grid: dict[str, list[float]] = {}
    for item in [value] if isinstance(value, str) else value:
        if names is None:
            key, values = "*", item
        else:
            key, _, values = item.partition(":")
            if key not in names:
                raise UserError(f"--lr-grid {item!r}: {key!r} is not one of --optimizers ({', '.join(names)}).")
        lrs = parse_list(values, "lr-grid", float, "0.05,0.1,0.2")
        if any(not math.isfinite(v) or v <= 0 for v in lrs):
            raise UserError(f"--lr-grid {item!r}: every lr must be a positive number.")
        grid[key] = lrs
    return grid


# --------------------------------------------------------------------------------------------- batch-scaling
def _yaml_value(v: object) -> str:
    return "null" if v is None else json.dumps(v) if not isinstance(v, str) else v


def cell_overrides(args, batch: int, opt: str, seed: int, lr: float | None = None) -> list[str]:
    """A batch-scaling cell's --set list: --set, the optimizer's settings (the protocol's `optimizers`, with its
    --opt-set), the batch and the study's keys."""
    optimizers = protocol.of_args("batch-scaling", args).optimizers
    settings = dict(optimizers[opt])
    for item in args.opt_set:
        name, _, kv = item.partition(":")
        if name not in optimizers or "=" not in kv:
            raise UserError(f"--opt-set {item!r} is not OPT:section.key=value with OPT one of "
                            f"{', '.join(optimizers)}.")
        if name == opt:
            key, _, value = kv.partition("=")
            settings[key] = value
    sets = [f"{k}={_yaml_value(v)}" for k, v in settings.items()]
    sets += [f"batch.global_batch={batch}", "batch.phases=[]", f"batch.micro_batch={args.micro_batch}",
             "batch.accumulation=null", f"train.seed={seed}", "train.plots=false", "train.eval_every=0"]
    if args.epochs is not None:
        sets.append(f"schedule.epochs={args.epochs}")
    if lr is not None:
        sets.append(f"optim.lr={lr:g}")
    if getattr(args, "val_split", None):
        sets.append(f"data.val_split={args.val_split}")
    return list(args.overrides) + sets


def claim_cells(batches: list[int], optimizers: list[str], claims: tuple[Claim, ...] | None = None,
                baseline: dict[str, object] | None = None) -> set[tuple[int, str]]:
    """--claims-only: the (batch, optimizer) pairs the claims read, of those given: the baseline (its optimizer
    at the smallest batch) and each claim's cell, with the row it is measured against where it names one (the
    package protocol's claims and baseline unless given). Without the baseline or any claim's cell, one
    sentence."""
    claims = protocol.default("batch-scaling").claims if claims is None else claims
    baseline = protocol.default("batch-scaling").baseline if baseline is None else baseline
    assert baseline is not None
    base_opt = str(baseline["optimizer"])
    if base_opt not in optimizers:
        raise UserError(f"--claims-only measures every claim against {base_opt.upper()} at the smallest batch; add "
                        f"{base_opt} to --optimizers.")
    base = min(batches)
    cells = [(c.cell["batch"], c.cell["optimizer"]) for c in claims]
    pairs: set[tuple[int, str]] = set()
    for claim in claims:   # a claim with an `against` of its own reads that row, at any batch; else the baseline
        b, o = claim.cell["batch"], claim.cell["optimizer"]
        ref: tuple[Any, Any] | None = (claim.against["batch"], claim.against["optimizer"]) if claim.against else None
        if b in batches and o in optimizers and (b != base or ref is not None) and \
                (ref is None or (ref[0] in batches and ref[1] in optimizers)):
            pairs |= {(b, o), *([ref] if ref else [])}
    if not pairs:
        known = ", ".join(f"{o} at {b}" for b, o in cells)
        raise UserError(f"--claims-only: no claim's cell is in --batches and --optimizers; the claims read {known}, "
                        f"each against {base_opt} at the smallest batch.")
    return pairs | {(base, base_opt)}


def scaling_layout(kind, args) -> Layout:
    """batch-scaling's groups: every (batch, optimizer) of --batches x --optimizers, batch-major."""
    batches = parse_list(args.batches, "batches", int)
    optimizers = parse_list(args.optimizers, "optimizers", str)
    known = kind.protocol.optimizers
    bad = [o for o in optimizers if o not in known]
    if bad:
        raise UserError(f"--optimizers has {bad}; choose from the protocol's: {', '.join(known)}.")
    check_numbers(*[("--batches", b, b >= 1, "positive global batches") for b in batches])
    only = claim_cells(batches, optimizers, kind.protocol.claims, kind.protocol.baseline) if args.claims_only else None
    groups = [Group({"batch": b, "optimizer": o}, f"{o}-b{b}", f"{o} batch {b}", f"{o} at batch {b}", o,
                    partial(_scaling_sets, args, b, o))
              for b in batches for o in optimizers if only is None or (b, o) in only]
    return Layout(groups, optimizers, {"batches": batches, "optimizers": optimizers}, "cell")


def _scaling_sets(args, batch: int, opt: str, lr: float | None, seed: int) -> list[str]:
    return cell_overrides(args, batch, opt, seed, lr)


# ---------------------------------------------------------------------------------------- the variant kinds
def _control(args) -> dict[str, Any]:
    """batch-control's own flags: a positive start batch, a switch at a whole epoch inside the budget."""
    check_numbers(("--start-batch", args.start_batch, args.start_batch >= 1, "a positive global batch"))
    if not 0 < args.switch_epochs < args.epochs or not float(args.switch_epochs).is_integer():
        raise UserError(f"--switch-epochs is {args.switch_epochs}; give a whole number of epochs inside the budget "
                        f"(0, {args.epochs:g}).")
    return {}


def _cycles(args) -> dict[str, Any]:
    """ensemble's own flags: 1 or more cycles of positive length that leave the base schedule more epochs than a
    collapse; its epochs before the cycles (`base_epochs`)."""
    epochs = (("--cycle-epochs", args.cycle_epochs), ("--collapse-epochs", args.collapse_epochs))
    check_numbers(("--cycles", args.cycles, args.cycles >= 1, "1 or more (with 0 both variants are one model)"),
                  *[(flag, v, 0 < v < math.inf, "a positive number of epochs") for flag, v in epochs])
    base = args.epochs - args.cycles * args.cycle_epochs
    if base <= args.collapse_epochs:
        raise UserError(f"--cycles {args.cycles} x --cycle-epochs {args.cycle_epochs:g} leaves "
                        f"{max(base, 0.0):g} of the {args.epochs:g} epochs for the base schedule, which needs more "
                        f"than --collapse-epochs ({args.collapse_epochs:g}); give fewer or shorter cycles, or more "
                        "--epochs.")
    return {"base_epochs": base}


_VARIANT_CHECKS: dict[str, Callable[[Any], dict[str, Any]]] = {"batch-control": _control, "ensemble": _cycles}


def variants(kind: str, args) -> dict[str, list[str]]:
    """Each variant's --set list (on top of the recipe and --set): the cells' common keys, then its own
    (the protocol's `variants` formatted with the flags, or --own-schedule's)."""
    common = [f"batch.micro_batch={args.micro_batch}", "batch.accumulation=null", "train.plots=false",
              "train.eval_every=0"]
    if args.val_split:
        common.append(f"data.val_split={args.val_split}")
    check_numbers(("--batch", args.batch, args.batch >= 1, "a positive global batch"))
    if getattr(args, "own_schedule", False):
        return own_schedule(args, common)
    values = {**vars(args), **_VARIANT_CHECKS[kind](args)}
    own = protocol.of_args(kind, args).variants
    return {name: common + [_format(s, values, kind, name) for s in sets] for name, sets in own.items()}


def _format(item: str, values: dict[str, Any], kind: str, name: str) -> str:
    """A variant's --set item with the study's flags in place of its {fields}; a field the study has not is one
    sentence."""
    try:
        return item.format(**values)
    except (KeyError, IndexError, ValueError) as err:
        fields = ", ".join(sorted(k for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)))
        raise UserError(f"the protocol's variant {name!r} has the --set item {item!r}, which study {kind} cannot fill "
                        f"({err}); use {{FIELD}} of the study's numbers ({fields}), and {{{{ }}}} for braces.") from None


def own_schedule(args, common: list[str]) -> dict[str, list[str]]:
    """--own-schedule: the recipe's base run and ensemble.segments scaled to --epochs (every epoch count times
    epochs / the recipe's total), against one model of the recipe's base form for all --epochs."""
    from largebatch import config as config_mod
    from largebatch.schedule import ensemble_epochs

    cfg = config_mod.load(args.recipe, list(args.overrides))
    if not cfg.ensemble.segments:
        raise UserError(f"--own-schedule takes the recipe's ensemble.segments, and {args.recipe} has none; give a "
                        "recipe with segments (e.g. fashion_mnist_collapsed_released) or leave --own-schedule out.")
    s = cfg.schedule
    f = args.epochs / (s.epochs + ensemble_epochs(cfg.ensemble))

    def scaled(x: float) -> str:
        return f"{round(x * f, 3):g}"
    segments = [{**dataclasses.asdict(g), "epochs": float(scaled(g.epochs)),
                 "rewarm_epochs": float(scaled(g.rewarm_epochs))} for g in cfg.ensemble.segments]
    base = [f"batch.global_batch={args.batch}", "batch.phases=[]", "ensemble.cycles=0"]
    return {"single": common + base + [f"schedule.epochs={args.epochs:g}", "schedule.decay_epochs=null",
                                       f"schedule.warmup_epochs={scaled(s.warmup_epochs)}", "ensemble.segments=[]"],
            "ensemble": common + base + [
                f"schedule.epochs={scaled(s.epochs)}", f"schedule.warmup_epochs={scaled(s.warmup_epochs)}",
                *([f"schedule.decay_epochs={scaled(s.decay_epochs)}"] if s.decay_epochs else []),
                f"ensemble.segments={json.dumps(segments)}"]}


def variant_layout(kind, args) -> Layout:
    """A variant kind's groups: its variants, in `variants`' order."""
    return Layout([Group({"variant": name}, name, name, name, "*", partial(_variant_sets, args, sets))
                   for name, sets in variants(kind.name, args).items()])


def _variant_sets(args, sets: list[str], lr: float | None, seed: int) -> list[str]:
    return list(args.overrides) + sets + ([f"optim.lr={lr:g}"] if lr is not None else []) + [f"train.seed={seed}"]


# --------------------------------------------------------------------------------------------------- cells
Cell = tuple[Group, float | None, int]


def plan_cells(layout: Layout, seeds: int, grid: dict[str, list[float]],
               chosen: dict[tuple, float | None] | None = None) -> list[Cell]:
    """(group, lr, seed) of every cell, seeds outermost; the lr from the grid, or from a tuning's choice."""
    lrs: dict[tuple, list[float | None]] = {}
    for g in layout.groups:
        if chosen is not None:
            if g.key not in chosen:
                raise UserError(f"--from-tuning has no choice for {g.what}; tune that {layout.noun} too.")
            lrs[g.key] = [chosen[g.key]]
        else:
            grid_lrs: list[float | None] = list(grid.get(g.grid_key, []))
            lrs[g.key] = grid_lrs or [None]
    return [(g, lr, s) for s in range(seeds) for g in layout.groups for lr in lrs[g.key]]


def cell_dir(out: Path, group: Group, lr: float | None, seed: int) -> Path:
    return out / "runs" / (f"{group.slug}-s{seed}" if lr is None else f"{group.slug}-lr{lr:g}-s{seed}")


def cell_label(group: Group, lr: float | None, seed: int) -> str:
    return f"{group.label}{'' if lr is None else f' lr {lr:g}'} seed {seed}"


def check_cells(args, cells: list[Cell]) -> int:
    """Every planned group's plan resolves (divisibility, batch against the dataset's size) before anything
    trains, at its first lr; the training images per cell."""
    from largebatch import config as config_mod
    from largebatch.commands.train import _train_size, dry_run

    first: dict[tuple, Cell] = {}
    for cell in cells:
        first.setdefault(cell[0].key, cell)
    group, lr, _ = next(iter(first.values()))
    size, _ = _train_size(config_mod.load(args.recipe, group.sets(lr, 0)))
    whole = size + (args.val_split or 0)   # data.train_size counts the images before the split
    for group, lr, _ in first.values():
        dry_run(config_mod.load(args.recipe, group.sets(lr, 0) + [f"data.train_size={whole}"]), args.nproc_per_node)
    return size
