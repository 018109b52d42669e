"""`largebatch study batch-control` and `largebatch study ensemble`: two variants of one recipe at equal epochs,
over seeds, each a table of its own.

- batch-control (Sony, Mikami et al.): `fixed` trains at --batch for the whole budget; `control` trains at
  --start-batch for --switch-epochs, then at --batch. The claim: control is above fixed, beyond the seeds' spread.
- ensemble (Codreanu et al.): `single` trains one model for --epochs; `ensemble` spends the same --epochs as a
  base schedule plus --cycles cycles of --cycle-epochs, each ending in a collapse and a snapshot, and is
  evaluated as the softmax average of its snapshots. The claims: the ensemble at least 0.3 points above its
  best snapshot, and at least equal to the single model.

Cells run as in `study batch-scaling` (`study.run_cell`): each a `largebatch train` of its own, resumable, its
exact command in OUT/study.json; the study directory is the study's alone, checked, locked and written whole, and
SIGTERM/SIGINT stop the running cell resumably, as in `study batch-scaling` (its steps 4-6); OUT/study.md holds the table (mean ± sample std over seeds), OUT/study.png the
bars and each variant's training loss against epoch. Tuned as the batch-scaling study is, never on the test set:
- tuning: `--val-split N --lr-grid A,B,C` runs every variant at every optim.lr of the grid (an equal budget per
  variant) and evaluates on N held-out training images; each variant's chosen lr is its best mean there;
- final: `--from-tuning TUNING_OUT` runs each variant at its chosen lr, on the test set.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from largebatch.commands import study
from largebatch.cli import ArgumentParser, check_numbers
from largebatch.config import MAX_EPOCHS
from largebatch.errors import UserError


def parser(kind: str) -> ArgumentParser:
    # this command's own bullet of the docstring (the help showed both commands' as one run-on paragraph)
    own = next(b for b in __doc__.split("\n\n")[1].split("\n- ") if b.lstrip("- ").startswith(kind))
    p = ArgumentParser(prog=f"largebatch study {kind}", description=" ".join(own.lstrip("- ").split()))
    p.add_argument("--recipe", default="fashion_mnist", help="recipe every cell starts from")
    p.add_argument("--epochs", type=float, default=24.0, help="epoch budget of every cell")
    p.add_argument("--seeds", type=int, default=3, help="seeds per variant (0..N-1)")
    p.add_argument("--out", type=Path, default=Path(f"runs/study-{kind}"), help="study directory")
    p.add_argument("--nproc-per-node", type=int, default=2, help="workers per cell")
    p.add_argument("--micro-batch", type=int, default=512, help="largest per-worker forward batch")
    p.add_argument("--val-split", type=int, default=None, help="evaluate on this many held-out training images")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe key in every cell (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="check and list the cells, train nothing")
    p.add_argument("--lr-grid", default=None, metavar="A,B,...",
                   help="optim.lr values every variant runs at (with --val-split: the tuning study)")
    p.add_argument("--from-tuning", type=Path, default=None, metavar="TUNING_OUT",
                   help="run each variant at the lr that tuning study chose, on the test set")
    if kind == "batch-control":
        p.add_argument("--batch", type=int, default=3072, help="the large global batch (ImageNet ~64K on 60,000 images)")
        p.add_argument("--start-batch", type=int, default=384, help="the control variant's batch before the switch")
        p.add_argument("--switch-epochs", type=float, default=6.0, help="epochs at --start-batch before --batch")
    else:
        p.add_argument("--batch", type=int, default=384, help="global batch of both variants")
        p.add_argument("--cycles", type=int, default=2, help="cycles after the base schedule")
        p.add_argument("--cycle-epochs", type=float, default=4.0, help="epochs of one cycle")
        p.add_argument("--collapse-epochs", type=float, default=1.0, help="collapse at the end of each segment")
        p.add_argument("--own-schedule", action="store_true",
                       help="the ensemble variant is the recipe's own ensemble.segments schedule (its base run, "
                            "segments and collapses, e.g. the authors' released one), scaled to --epochs; "
                            "--cycles, --cycle-epochs and --collapse-epochs do not apply")
    return p


def own_schedule(args, common: list[str]) -> dict[str, list[str]]:
    """--own-schedule: the recipe's base run and ensemble.segments scaled to --epochs (every epoch count times
    epochs / the recipe's total), against one model of the recipe's base form for all --epochs."""
    import dataclasses

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
    segments = [{**dataclasses.asdict(g), "epochs": float(scaled(g.epochs)), "rewarm_epochs": float(scaled(g.rewarm_epochs))}
                for g in cfg.ensemble.segments]
    base = [f"batch.global_batch={args.batch}", "batch.phases=[]", "ensemble.cycles=0"]
    return {"single": common + base + [f"schedule.epochs={args.epochs:g}", "schedule.decay_epochs=null",
                                       f"schedule.warmup_epochs={scaled(s.warmup_epochs)}", "ensemble.segments=[]"],
            "ensemble": common + base + [
                f"schedule.epochs={scaled(s.epochs)}", f"schedule.warmup_epochs={scaled(s.warmup_epochs)}",
                *([f"schedule.decay_epochs={scaled(s.decay_epochs)}"] if s.decay_epochs else []),
                f"ensemble.segments={json.dumps(segments)}"]}


def variants(kind: str, args) -> dict[str, list[str]]:
    """The --set list of each variant (on top of the recipe and --set)."""
    common = [f"batch.micro_batch={args.micro_batch}", "batch.accumulation=null", "train.plots=false",
              "train.eval_every=0"]
    if args.val_split:
        common.append(f"data.val_split={args.val_split}")
    check_numbers(("--batch", args.batch, args.batch >= 1, "a positive global batch"))
    if kind == "batch-control":
        check_numbers(("--start-batch", args.start_batch, args.start_batch >= 1, "a positive global batch"))
        if not 0 < args.switch_epochs < args.epochs or not float(args.switch_epochs).is_integer():
            raise UserError(f"--switch-epochs is {args.switch_epochs}; give a whole number of epochs inside the budget "
                            f"(0, {args.epochs:g}).")
        phases = (f"[{{start_epoch: 0, global_batch: {args.start_batch}}}, "
                  f"{{start_epoch: {args.switch_epochs:g}, global_batch: {args.batch}}}]")
        return {"fixed": common + [f"schedule.epochs={args.epochs:g}", f"batch.global_batch={args.batch}",
                                   "batch.phases=[]"],
                "control": common + [f"schedule.epochs={args.epochs:g}", f"batch.global_batch={args.batch}",
                                     f"batch.phases={phases}"]}
    if getattr(args, "own_schedule", False):
        return own_schedule(args, common)
    epochs = (("--cycle-epochs", args.cycle_epochs), ("--collapse-epochs", args.collapse_epochs))
    check_numbers(("--cycles", args.cycles, args.cycles >= 1, "1 or more (with 0 both variants are one model)"),
                  *[(flag, v, 0 < v < math.inf, "a positive number of epochs") for flag, v in epochs])
    base = args.epochs - args.cycles * args.cycle_epochs
    if base <= args.collapse_epochs:
        raise UserError(f"--cycles {args.cycles} x --cycle-epochs {args.cycle_epochs:g} leaves "
                        f"{max(base, 0.0):g} of the {args.epochs:g} epochs for the base schedule, which needs more "
                        f"than --collapse-epochs ({args.collapse_epochs:g}); give fewer or shorter cycles, or more "
                        "--epochs.")
    return {"single": common + [f"schedule.epochs={args.epochs:g}", f"batch.global_batch={args.batch}",
                                "batch.phases=[]", "ensemble.cycles=0"],
            "ensemble": common + [f"schedule.epochs={base:g}", f"batch.global_batch={args.batch}", "batch.phases=[]",
                                  f"ensemble.cycles={args.cycles}", f"ensemble.cycle_epochs={args.cycle_epochs:g}",
                                  f"ensemble.collapse_epochs={args.collapse_epochs:g}"]}


def chosen_lrs(kind: str, tuning_out: Path) -> dict[str, float | None]:
    """Each variant's chosen lr in a finished tuning study of the same kind (run with --val-split)."""
    path = tuning_out / "study.json"
    data = study.read_study(path, kind)
    if not data.get("val_split"):
        raise UserError(f"--from-tuning: {path} is not a {kind} study run with --val-split (its choices must not have "
                        "seen the test set); tune with --val-split N --lr-grid ... first.")
    chosen = {name: row.get("lr") for name, row in data["table"].items() if name != "verdict" and isinstance(row, dict)}
    for name, lr in chosen.items():
        if lr is not None and not (study._is_number(lr) and lr > 0):
            raise UserError(f"--from-tuning: {path} has lr {lr!r} for variant {name!r}, not a positive number or null; "
                            "restore that study.json from the tuning study's cells, or give the --out of another "
                            "tuning study.")
    if not chosen:
        raise UserError(f"--from-tuning: {path} has no finished cell yet; finish the tuning study first.")
    return chosen


def summarise(kind: str, cells: list[dict]) -> dict:
    """Per variant, at its chosen lr (the best mean over the lrs run; the only one without a grid): top-1 (the
    ensemble's own for the ensemble variant) mean and std, how many lrs ran and diverged; and the claim's verdict."""
    table: dict = {}
    for name in sorted({c["variant"] for c in cells}):
        mine = [c for c in cells if c["variant"] == name]
        key = "ensemble_top1" if kind == "ensemble" and name == "ensemble" else "top1"
        rows = []
        for lr in sorted({c.get("lr") for c in mine}, key=lambda v: -1.0 if v is None else v):
            done = [c for c in mine if c.get("lr") == lr and c.get("top1") is not None]
            if not done:
                continue
            mean, std = study.mean_std([c.get(key, c["top1"]) for c in done])
            row = {"variant": name, "lr": lr, "top1_mean": mean, "top1_std": std, "seeds": len(done)}
            if kind == "ensemble" and name == "ensemble":
                row["best_snapshot_mean"], row["best_snapshot_std"] = study.mean_std([c["best_snapshot_top1"] for c in done])
                if all("swa_top1" in c for c in done):   # with ensemble.swa: the snapshots' weight average
                    row["swa_mean"], row["swa_std"] = study.mean_std([c["swa_top1"] for c in done])
            rows.append(row)
        if not rows:
            continue
        table[name] = {**max(rows, key=lambda r: r["top1_mean"]), "lrs_run": len({c.get("lr") for c in mine}),
                       "lrs_diverged": len({c.get("lr") for c in mine if c.get("diverged")})}
    a, b = ("control", "fixed") if kind == "batch-control" else ("ensemble", "single")
    if a in table and b in table:
        diff = table[a]["top1_mean"] - table[b]["top1_mean"]
        spread = max(table[a]["top1_std"], table[b]["top1_std"])
        table["verdict"] = {"difference": diff, "spread": spread, "holds": diff > spread}
        if kind == "ensemble":
            gain = table[a]["top1_mean"] - table[a]["best_snapshot_mean"]
            table["verdict"].update(gain_over_best_snapshot=gain,
                                    holds=diff >= 0 and gain >= 0.003)
    return table


def markdown(kind: str, table: dict, split: str) -> str:
    with_lr = any(r.get("lr") is not None for n, r in table.items() if n != "verdict")
    rows = [f"| variant | {split} top-1 (%) | seeds |" + (" best snapshot (%) |" if kind == "ensemble" else "")
            + (" lr |" if with_lr else ""),
            "|---|---:|---:|" + ("---:|" if kind == "ensemble" else "") + ("---:|" if with_lr else "")]
    for name, r in table.items():
        if name == "verdict":
            continue
        extra = ""
        if kind == "ensemble":
            extra = (f" {100 * r['best_snapshot_mean']:.2f} ± {100 * r['best_snapshot_std']:.2f} |"
                     if "best_snapshot_mean" in r else " |")
        if with_lr:
            runs = r.get("lrs_run", 1)
            tried = f" (best of {runs}" + (f", {r['lrs_diverged']} diverged" if r.get("lrs_diverged") else "") + ")"
            extra += f" {r['lr']:g}{tried if runs > 1 else ''} |"
        rows.append(f"| {name} | {100 * r['top1_mean']:.2f} ± {100 * r['top1_std']:.2f} | {r['seeds']} |{extra}")
    swa = table.get("ensemble", {})
    if kind == "ensemble" and "swa_mean" in swa:
        rows.append(f"| weight average of the snapshots (SWA, BN recomputed) | {100 * swa['swa_mean']:.2f} ± "
                    f"{100 * swa['swa_std']:.2f} | {swa['seeds']} |" + " |" + (" |" if with_lr else ""))
    v = table.get("verdict")
    if v:
        what = ("control above fixed beyond the seeds' spread" if kind == "batch-control" else
                "ensemble >= single model and >= best snapshot + 0.3")
        rows.append("")
        rows.append(f"Claim ({what}): difference {100 * v['difference']:+.2f} points, spread {100 * v['spread']:.2f}"
                    + (f", gain over the best snapshot {100 * v['gain_over_best_snapshot']:+.2f}"
                       if "gain_over_best_snapshot" in v else "")
                    + f": **{'held' if v['holds'] else 'did not hold'}**.")
    return "\n".join(rows) + "\n"


def loss_curves(table: dict, cells: list[dict]) -> dict[str, list[tuple[float, float, float, float]]]:
    """Per variant, at its chosen lr: the training loss against epoch over its finished seeds, as
    (epoch, mean, min, max) at the epochs every seed logged (the seeds share one schedule)."""
    curves = {}
    for name, row in table.items():
        if name == "verdict":
            continue
        runs = [{r["epoch"]: r["loss"] for r in study._train_records(Path(c["run_dir"]))}
                for c in cells if c["variant"] == name and c.get("lr") == row.get("lr") and c.get("top1") is not None]
        epochs = sorted(set.intersection(*(set(r) for r in runs))) if runs else []
        curves[name] = [(e, sum(r[e] for r in runs) / len(runs), min(r[e] for r in runs), max(r[e] for r in runs))
                        for e in epochs]
    return curves


def plot(table: dict, path: Path, split: str, curves: dict | None = None) -> None:
    """Left: top-1 per variant (mean, error bar = std over seeds), for the ensemble study also its best
    snapshot and the snapshots' weight average; right, with `curves`: training loss against epoch per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in table if n != "verdict"]
    bars = [(n, table[n]["top1_mean"], table[n]["top1_std"]) for n in names]
    ens = table.get("ensemble", {})
    if "best_snapshot_mean" in ens:
        bars.append(("best snapshot", ens["best_snapshot_mean"], ens["best_snapshot_std"]))
    if "swa_mean" in ens:
        bars.append(("SWA", ens["swa_mean"], ens["swa_std"]))
    colours = ["#4c72b0", "#dd8452", "#8c8c8c", "#55a868"]
    with_curves = curves is not None and any(curves.values())
    fig, axes = plt.subplots(1, 2 if with_curves else 1, figsize=(9.5 if with_curves else 4.5, 3.5), squeeze=False)
    ax = axes[0][0]
    ax.bar([b[0] for b in bars], [100 * b[1] for b in bars], yerr=[100 * b[2] for b in bars], capsize=4,
           color=colours[: len(bars)])
    low = min(100 * (b[1] - b[2]) for b in bars)
    high = max(100 * (b[1] + b[2]) for b in bars)
    ax.set_ylim(max(0.0, low - max(1.0, high - low)), min(100.0, high + 0.25 * max(1.0, high - low)))
    ax.set_ylabel(f"{split} top-1 (%)")
    ax.grid(axis="y", alpha=0.3)
    if curves is not None and with_curves:
        lx = axes[0][1]
        for i, (name, points) in enumerate(curves.items()):
            if not points:
                continue
            e, mean, lo, hi = zip(*points)
            lx.plot(e, mean, color=colours[i % len(colours)], label=name)
            lx.fill_between(e, lo, hi, color=colours[i % len(colours)], alpha=0.2)
        lx.set_xlabel("epoch")
        lx.set_ylabel("training loss")
        lx.set_title("mean over seeds, band: their range", fontsize=9)
        lx.grid(alpha=0.3)
        lx.legend()
    fig.tight_layout()
    study.save_figure(fig, path)
    plt.close(fig)


def run(kind: str, argv: list[str]) -> int:
    args = parser(kind).parse_args(argv)
    check_numbers(("--seeds", args.seeds, args.seeds >= 1, "1 or more"),
                  ("--nproc-per-node", args.nproc_per_node, args.nproc_per_node >= 1, "1 or more"),
                  ("--micro-batch", args.micro_batch, args.micro_batch >= 1, "1 or more"),
                  ("--epochs", args.epochs, 0 < args.epochs <= MAX_EPOCHS,
                   f"a positive number of epochs (at most {MAX_EPOCHS:,})"),
                  ("--val-split", args.val_split, args.val_split is None or args.val_split >= 1, "1 or more"))
    plan = variants(kind, args)
    if args.from_tuning is not None and (args.lr_grid is not None or args.val_split):
        raise UserError("--from-tuning runs the chosen settings on the test set; leave out --lr-grid and --val-split.")
    if args.lr_grid is not None:   # an empty --lr-grid "" is refused by _parse_list, not taken as no grid
        grid: list[float] = study._parse_list(args.lr_grid, "lr-grid", float, "0.05,0.1,0.2")
        check_numbers(*[("--lr-grid", v, math.isfinite(v) and v > 0, "positive learning rates") for v in grid])
        lrs: dict[str, list[float | None]] = {name: list(grid) for name in plan}
    elif args.from_tuning is not None:
        chosen = chosen_lrs(kind, args.from_tuning)
        missing = sorted(set(plan) - set(chosen))
        if missing:
            raise UserError(f"--from-tuning has no choice for {', '.join(missing)}; tune that variant too.")
        lrs = {name: [chosen[name]] for name in plan}
    else:
        lrs = {name: [None] for name in plan}

    def sets_of(name: str, lr: float | None, seed: int) -> list[str]:
        return (list(args.overrides) + plan[name] + ([f"optim.lr={lr:g}"] if lr is not None else [])
                + [f"train.seed={seed}"])

    from largebatch import config as config_mod
    from largebatch.commands.train import dry_run

    for name in plan:   # every cell resolves before anything trains
        for lr in lrs[name]:
            dry_run(config_mod.load(args.recipe, sets_of(name, lr, 0)), args.nproc_per_node)
    from rich.console import Console

    console = Console(stderr=True)
    held = study.take_out(args.out, args.dry_run)
    try:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("dry_run", "out")}
        stored = args.out / study.SETTINGS
        if stored.exists() and not study.same_study(study.stored_settings(stored), settings):
            raise UserError(f"{args.out} holds a study with other settings ({stored}); resume it with the same "
                            "arguments (the lr grid may grow), or use another --out.")
        order = [(name, lr, s) for s in range(args.seeds) for name in plan for lr in lrs[name]]
        cell_dirs = [args.out / "runs" / (f"{name}-s{s}" if lr is None else f"{name}-lr{lr:g}-s{s}")
                     for name, lr, s in order]
        earlier = study.check_files(args.out, cell_dirs)   # before any cell trains (and before anything is written)
        if not args.dry_run:
            study.write_file(stored, json.dumps(settings, indent=2))
        import torch

        from largebatch.commands.bench import machine

        split = "validation" if args.val_split else "test"
        meta = {"command": f"largebatch study {kind} " + " ".join(argv), "kind": kind, **settings,
                "machine": machine(torch.device("cpu")), "split": split}
        cells: list[dict] = []
        stop = None if args.dry_run else study.Stop()
        if stop is not None:
            stop.install()
        for i, ((name, lr, s), run_dir) in enumerate(zip(order, cell_dirs)):
            if stop is not None and stop.signum is not None:
                break
            label = f"{name}{'' if lr is None else f' lr {lr:g}'} seed {s}"
            cell = {"variant": name, "lr": lr, "seed": s,
                    **study.run_cell(args, run_dir, sets_of(name, lr, s), label, f"{i + 1}/{len(order)}", console,
                                     earlier, stop)}
            cells.append(cell)
            if args.dry_run:
                continue
            table = summarise(kind, cells)
            study.write_file(args.out / "study.json", json.dumps({**meta, "cells": cells, "table": table}, indent=2))
            machines = study.machines(cells)   # not str.capitalize(): it lowercases the CPU's name
            study.write_file(args.out / "study.md", f"Command: `{meta['command']}`\n\n{machines[:1].upper() + machines[1:]}; "
                             f"machine time of the finished cells: {study.machine_time(cells)}\n\n"
                             + markdown(kind, table, split))
            if any(n != "verdict" for n in table):
                plot(table, args.out / "study.png", split, loss_curves(table, cells))
        console.print(markdown(kind, summarise(kind, cells), split))
        if args.dry_run:
            console.print(f"study: dry run, {len(cells)} cells listed; nothing written to {args.out}")
            return 0
        if stop is not None and stop.signum is not None:
            return study.stopped(args.out, stop.signum, console, held)
        console.print(f"study: {sum(c['top1'] is not None for c in cells)}/{len(cells)} cells done in "
                      f"{study.machine_time(cells)} of training; results in "
                      f"{args.out / 'study.md'}, {args.out / 'study.json'}, {args.out / 'study.png'}")
        return 0
    finally:   # an error or a stop after --out was taken releases it too (the flock of this process)
        if held is not None:
            held.release()


def main_batch_control(argv: list[str]) -> int:
    return run("batch-control", argv)


def main_ensemble(argv: list[str]) -> int:
    return run("ensemble", argv)
