"""`largebatch study batch-scaling`: top-1 against global batch per optimizer at a fixed epoch budget.

The shape of Goyal et al.'s error-vs-minibatch figure and You et al.'s LARS tables:

1. Cells: every (global batch, optimizer, seed) of the command line. Every cell trains the same
   recipe for the same `--epochs`; a batch whose per-worker share exceeds `--micro-batch` uses
   gradient accumulation. "sgd" is Goyal's recipe (momentum SGD, linear scaling rule, gradual
   warm-up from the unscaled lr); "lars" and "lamb" take the settings of OPTIMIZER_SETTINGS,
   which `--opt-set OPT:section.key=value` overrides.
2. Check every cell's plan up front (`--dry-run` arithmetic), so an impossible batch fails at once.
3. Run the cells one after another, each a `largebatch train` of its own (its own torchrun world,
   run directory OUT/runs/OPT-bBATCH-sSEED). A cell with a summary.json is done; a cell with
   checkpoints resumes from them: an interrupted study continues where it stopped.
4. After every cell write OUT/study.json (all cells), OUT/study.md (top-1 mean and spread per
   batch x optimizer, and the final training loss) and OUT/study.png (top-1 vs global batch).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from largebatch import rundir
from largebatch.cli import ArgumentParser, check_numbers
from largebatch.errors import UserError

# Step 1: what each optimizer name means in the study (applied on top of the recipe).
OPTIMIZER_SETTINGS: dict[str, dict[str, object]] = {
    "sgd": {"optim.name": "sgd", "optim.scaling_rule": "linear", "schedule.warmup_start_lr": None},
    "lars": {"optim.name": "lars", "optim.scaling_rule": "linear", "optim.lr": 2.0,
             "optim.trust_coefficient": 0.001, "schedule.warmup_start_lr": 0.0},
    "lamb": {"optim.name": "lamb", "optim.scaling_rule": "sqrt", "optim.lr": 0.004,
             "optim.weight_decay": 0.01, "schedule.warmup_start_lr": 0.0},
}


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="largebatch study batch-scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="fashion_mnist", help="recipe every cell starts from")
    p.add_argument("--batches", default="256,1024,4096,8192,16384", help="comma-separated global batches")
    p.add_argument("--optimizers", default="sgd,lars,lamb", help=f"comma-separated, of {', '.join(OPTIMIZER_SETTINGS)}")
    p.add_argument("--epochs", type=float, default=None, help="epoch budget of every cell (default: the recipe's)")
    p.add_argument("--seeds", type=int, default=1, help="seeds per cell (0..N-1)")
    p.add_argument("--out", type=Path, default=Path("runs/study-batch-scaling"), help="study directory")
    p.add_argument("--nproc-per-node", type=int, default=2, help="workers per cell")
    p.add_argument("--micro-batch", type=int, default=512, help="largest per-worker forward batch (accumulation above it)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe key in every cell (repeatable)")
    p.add_argument("--opt-set", action="append", default=[], metavar="OPT:SECTION.KEY=VALUE",
                   help="override a key for one optimizer's cells, e.g. lars:optim.lr=4")
    p.add_argument("--dry-run", action="store_true", help="check and list the cells, train nothing")
    return p


def _parse_list(text: str, what: str, cast) -> list:
    try:
        items = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--{what} {text!r} is not a comma-separated list; e.g. --{what} 256,1024.") from None
    if not items:
        raise UserError(f"--{what} is empty; give at least one value.")
    return items


def _yaml_value(v: object) -> str:
    return "null" if v is None else json.dumps(v) if not isinstance(v, str) else v


def cell_overrides(args, batch: int, opt: str, seed: int) -> list[str]:
    """Step 1: the --set list of one cell."""
    settings = dict(OPTIMIZER_SETTINGS[opt])
    for item in args.opt_set:
        name, _, kv = item.partition(":")
        if name not in OPTIMIZER_SETTINGS or "=" not in kv:
            raise UserError(f"--opt-set {item!r} is not OPT:section.key=value with OPT one of "
                            f"{', '.join(OPTIMIZER_SETTINGS)}.")
        if name == opt:
            key, _, value = kv.partition("=")
            settings[key] = value
    sets = [f"{k}={_yaml_value(v)}" for k, v in settings.items()]
    sets += [f"batch.global_batch={batch}", "batch.phases=[]", f"batch.micro_batch={args.micro_batch}",
             "batch.accumulation=null", f"train.seed={seed}", "train.plots=false", "train.eval_every=0"]
    if args.epochs is not None:
        sets.append(f"schedule.epochs={args.epochs}")
    return list(args.overrides) + sets


def _cell_dir(out: Path, batch: int, opt: str, seed: int) -> Path:
    return out / "runs" / f"{opt}-b{batch}-s{seed}"


def _final_train_loss(run_dir: Path) -> float | None:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    loss = None
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "train":
            loss = rec["loss"]
    return loss


def summarise(cells: list[dict]) -> dict:
    """Mean and spread (sample std; 0 for one seed) of top-1 and final train loss per (batch, optimizer)."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for c in cells:
        if c.get("top1") is not None:
            groups.setdefault((c["batch"], c["optimizer"]), []).append(c)
    table = {}
    for (b, o), cs in sorted(groups.items()):
        top1 = [c["top1"] for c in cs]
        losses = [c["train_loss"] for c in cs if c.get("train_loss") is not None]
        mean = sum(top1) / len(top1)
        std = math.sqrt(sum((t - mean) ** 2 for t in top1) / (len(top1) - 1)) if len(top1) > 1 else 0.0
        table[f"{o}@{b}"] = {"batch": b, "optimizer": o, "top1_mean": mean, "top1_std": std, "seeds": len(top1),
                             "train_loss_mean": sum(losses) / len(losses) if losses else None}
    return table


def markdown(table: dict, batches: list[int], optimizers: list[str]) -> str:
    head = "| global batch | " + " | ".join(f"{o} top-1 (%) | {o} train loss" for o in optimizers) + " |"
    sep = "|---:|" + "---:|---:|" * len(optimizers)
    rows = [head, sep]
    for b in batches:
        cols = []
        for o in optimizers:
            c = table.get(f"{o}@{b}")
            if c is None:
                cols += ["(not run)", ""]
            else:
                cols.append(f"{100 * c['top1_mean']:.2f} ± {100 * c['top1_std']:.2f} (n={c['seeds']})")
                cols.append(f"{c['train_loss_mean']:.3f}" if c["train_loss_mean"] is not None else "")
        rows.append(f"| {b} | " + " | ".join(cols) + " |")
    return "\n".join(rows) + "\n"


def plot(table: dict, optimizers: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for o in optimizers:
        pts = sorted((c["batch"], c["top1_mean"], c["top1_std"]) for c in table.values() if c["optimizer"] == o)
        if pts:
            xs, ys, es = zip(*pts)
            ax.errorbar(xs, [100 * y for y in ys], yerr=[100 * e for e in es], marker="o", capsize=3, label=o)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch (images)")
    ax.set_ylabel("test top-1 (%)")
    ax.set_title("top-1 vs global batch at equal epochs")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _check_cells(args, batches, optimizers) -> None:
    """Step 2: every cell's plan resolves (divisibility, batch vs dataset size) before anything trains."""
    from largebatch import config as config_mod
    from largebatch.train_cli import _train_size, dry_run

    base = config_mod.load(args.recipe, cell_overrides(args, batches[0], optimizers[0], 0))
    size = _train_size(base)
    for b in batches:
        for o in optimizers:
            cfg = config_mod.load(args.recipe, cell_overrides(args, b, o, 0) + [f"data.train_size={size}"])
            dry_run(cfg, args.nproc_per_node)


def write_outputs(out: Path, meta: dict, cells: list[dict], batches: list[int], optimizers: list[str]) -> dict:
    """Step 4."""
    table = summarise(cells)
    batches = sorted(batches)
    (out / "study.json").write_text(json.dumps({**meta, "cells": cells, "table": table}, indent=2))
    md = (f"Command: `{meta['command']}`\n\nEpochs per cell: {meta['epochs']}, seeds: {meta['seeds']}, "
          f"workers per cell: {meta['nproc_per_node']}\n\n" + markdown(table, batches, optimizers))
    (out / "study.md").write_text(md)
    if table:
        plot(table, optimizers, out / "study.png")
    return table


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    batches = _parse_list(args.batches, "batches", int)
    optimizers = _parse_list(args.optimizers, "optimizers", str)
    bad = [o for o in optimizers if o not in OPTIMIZER_SETTINGS]
    if bad:
        raise UserError(f"--optimizers has {bad}; choose from {', '.join(OPTIMIZER_SETTINGS)}.")
    check_numbers(*((flag, value, value >= 1, "1 or more") for flag, value in (
        ("--seeds", args.seeds), ("--nproc-per-node", args.nproc_per_node), ("--micro-batch", args.micro_batch))))
    if args.epochs is not None and args.epochs <= 0:
        raise UserError(f"--epochs is {args.epochs}; give a positive number of epochs.")
    _check_cells(args, batches, optimizers)

    from rich.console import Console

    console = Console(stderr=True)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {"recipe": args.recipe, "epochs": args.epochs, "nproc_per_node": args.nproc_per_node,
                "micro_batch": args.micro_batch, "overrides": args.overrides, "opt_set": args.opt_set}
    stored = args.out / "study_settings.json"
    if stored.exists() and json.loads(stored.read_text()) != settings:
        raise UserError(f"{args.out} holds a study with other settings ({stored}); resume it with the same "
                        "--recipe/--epochs/--set/--opt-set/--micro-batch/--nproc-per-node, or use another --out.")
    stored.write_text(json.dumps(settings, indent=2))
    meta = {"command": "largebatch study batch-scaling " + " ".join(argv), **settings, "seeds": args.seeds,
            "batches": batches, "optimizers": optimizers}

    plan = [(b, o, s) for s in range(args.seeds) for b in batches for o in optimizers]   # in the order given
    cells: list[dict] = []
    for i, (b, o, s) in enumerate(plan):
        run_dir = _cell_dir(args.out, b, o, s)
        summary_path = run_dir / "summary.json"
        if not summary_path.exists():
            resume = rundir.holds_run(run_dir)   # a cell interrupted at any point continues where it was
            left = len(plan) - i
            console.print(f"[bold]study[/] cell {i + 1}/{len(plan)}: {o} batch {b} seed {s}"
                          f"{' (resuming)' if resume else ''}; {left - 1} cells left after this one")
            cmd = [sys.executable, "-m", "largebatch", "train", args.recipe, "--nproc-per-node",
                   str(args.nproc_per_node), "--run-dir", str(run_dir), "--quiet"]
            cmd += [x for kv in cell_overrides(args, b, o, s) for x in ("--set", kv)]
            if resume:
                cmd.append("--resume")
            if not args.dry_run:
                t0 = time.perf_counter()
                run_dir.mkdir(parents=True, exist_ok=True)
                with open(run_dir / "train.log", "a") as log:
                    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
                if proc.returncode != 0:
                    console.print(f"[red]study: cell {o} batch {b} seed {s} failed (exit {proc.returncode}); "
                                  f"see {run_dir / 'train.log'}[/]")
                else:
                    console.print(f"study: {o} batch {b} seed {s} done in {time.perf_counter() - t0:.0f} s")
        cell = {"batch": b, "optimizer": o, "seed": s, "run_dir": str(run_dir), "top1": None}
        if summary_path.exists():
            summ = json.loads(summary_path.read_text())
            cell.update({"top1": summ["final_top1"], "top5": summ["final_top5"], "test_loss": summ["final_loss"],
                         "train_loss": _final_train_loss(run_dir), "steps": summ["steps"], "wall_s": summ["wall_s"],
                         "epochs": summ["epochs"]})
        cells.append(cell)
        write_outputs(args.out, meta, cells, batches, optimizers)
    table = write_outputs(args.out, meta, cells, batches, optimizers)
    console.print(markdown(table, sorted(batches), optimizers))
    console.print(f"study: {sum(c['top1'] is not None for c in cells)}/{len(cells)} cells done; "
                  f"results in {args.out / 'study.md'}, {args.out / 'study.json'}, {args.out / 'study.png'}")
    return 0
