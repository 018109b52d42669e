"""`largebatch study batch-scaling`: top-1 against global batch per optimizer at a fixed epoch budget.

The shape of Goyal et al.'s error-vs-minibatch figure and You et al.'s LARS tables:

1. Cells: every (global batch, optimizer, seed) of the command line. Every cell trains the same
   recipe for the same `--epochs`; a batch whose per-worker share exceeds `--micro-batch` uses
   gradient accumulation. "sgd" is Goyal's recipe (momentum SGD, linear scaling rule, gradual
   warm-up from the unscaled lr); "lars" and "lamb" take the settings of OPTIMIZER_SETTINGS,
   which `--opt-set OPT:section.key=value` overrides.
2. Check every cell's plan up front (`--dry-run` arithmetic), so an impossible batch fails at once.
3. Run the cells one after another, each a `largebatch train` of its own (one process, or with
   --nproc-per-node 2 or more its own torchrun world; run directory OUT/runs/OPT-bBATCH-sSEED). A cell with a summary.json is done; a cell with
   checkpoints resumes from them: an interrupted study continues where it stopped.
   `--claims-only` keeps only the cells the papers' claims read (`CLAIMS`): SGD at the smallest batch and
   each claim's optimizer at its batch; with `--from-tuning` it re-checks the claims for a fraction of the
   grid's time.
4. After every cell write OUT/study.json (all cells, each with its exact `largebatch train` command),
   OUT/study.md (top-1 mean and spread per batch x optimizer (x lr), and the final training loss) and
   OUT/study.png (top-1 vs global batch, error bars over seeds, the ImageNet-equivalent batch on top),
   each written whole or not at all (written to a temporary file, then renamed).
5. The study directory (`take_out`) belongs to one study process at a time, as a run directory does: the study
   holds `fcntl.flock` on OUT/.largebatch.lock from its start to its end, and a second study on it is refused
   naming the holder. A study takes an empty or new directory, or one its study_settings.json marks as a study's;
   a directory that holds a training run or other files (a user's own study.md) is refused. SIGTERM and SIGINT
   (`Stop`) are forwarded to the running cell's processes (a process group of their own), which
   stop at the next step with a checkpoint; the study waits for them, records the cell as interrupted (not
   failed) and exits 128 + the signal; run again, it resumes that cell. A cell that the signal reaches after it
   wrote its summary is done, with its result.
6. Files a user can edit or damage are checked before any cell trains, each refused in one sentence naming the
   file: OUT/study.json (`earlier_machines`), every planned cell's summary.json (`read_summary`), a
   --from-tuning study.json's table (`_tuning_rows`).

Tuning without the test set, in two studies:
- tuning: `--lr-grid OPT:V1,V2,...` (per optimizer, repeatable) adds an lr axis to the cells and
  `--val-split N` holds N training images out (data.val_split); every cell is then evaluated on them.
  The table marks, per batch x optimizer, the lr with the best mean validation top-1.
- final: `--from-tuning TUNING_OUT` takes each batch x optimizer's chosen lr from that study's
  study.json (which must have used --val-split) and trains every seed on the full training set,
  reporting test top-1. It may be given more than once, for tuning studies of one protocol that extend
  each other (a batch tuned later, lr values beyond a grid's edge): the best validation top-1 over all
  their cells chooses.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from largebatch import rundir
from largebatch.cli import ArgumentParser, check_numbers, check_output_path
from largebatch.rundir import STATUSES, refuse_system
from largebatch.config import MAX_EPOCHS
from largebatch.errors import UserError
from largebatch.commands.train import STUDY_PID

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
    p.add_argument("--lr-grid", action="append", default=[], metavar="OPT:LR,LR,...",
                   help="tune: the optim.lr values to try for one optimizer (repeatable), e.g. lars:1,2,4")
    p.add_argument("--val-split", type=int, default=None,
                   help="tune: hold out this many training images and evaluate every cell on them (data.val_split)")
    p.add_argument("--from-tuning", type=Path, action="append", default=[], metavar="TUNING_OUT",
                   help="final: each batch x optimizer's lr chosen by the tuning study in this directory "
                        "(repeatable: the best over studies of one protocol)")
    p.add_argument("--claims-only", action="store_true",
                   help="run only the cells the papers' claims read: SGD at the smallest batch (the baseline) and "
                        "each claim's optimizer at its batch, of those in --batches and --optimizers")
    p.add_argument("--dry-run", action="store_true", help="check and list the cells, train nothing")
    return p


def lr_grid(items: list[str], optimizers: list[str]) -> dict[str, list[float]]:
    """--lr-grid OPT:V1,V2 items -> {optimizer: [lr, ...]}."""
    grid: dict[str, list[float]] = {}
    for item in items:
        name, _, values = item.partition(":")
        if name not in optimizers:
            raise UserError(f"--lr-grid {item!r}: {name!r} is not one of --optimizers ({', '.join(optimizers)}).")
        lrs = _parse_list(values, "lr-grid", float)
        if any(not math.isfinite(v) or v <= 0 for v in lrs):
            raise UserError(f"--lr-grid {item!r}: every lr must be a positive number.")
        grid[name] = lrs
    return grid


def same_study(old: dict, new: dict, optimizers: list[str] | None = None) -> bool:
    """Whether `new` settings continue the study stored with `old`: everything equal, except that the lr grid
    may grow (an optimum at the grid's edge is extended without re-running the cells already done), and so may
    the list of --from-tuning studies, at its end (a cell tuned later or re-run: the cells whose choice it
    changes run at the new lr, the others are kept). `optimizers`: the grid is per optimizer (--lr-grid OPT:A,B,
    repeatable); None: one grid for every variant (--lr-grid A,B, `study batch-control` and `study ensemble`)."""
    grows = ("lr_grid", "from_tuning")
    if {k: v for k, v in old.items() if k not in grows} != {k: v for k, v in new.items() if k not in grows}:
        return False
    tuned_before, tuned_after = old.get("from_tuning") or "", new.get("from_tuning") or ""
    if tuned_before and tuned_after != tuned_before and not tuned_after.startswith(tuned_before + ", "):
        return False
    if tuned_after and not tuned_before:   # a grid study does not become a final one
        return False
    def grid(value: Any) -> dict[str, list[float]]:
        if optimizers is not None:
            return lr_grid(value or [], optimizers)
        return {"*": _parse_list(value, "lr-grid", float)} if value else {}

    before, after = grid(old.get("lr_grid")), grid(new.get("lr_grid"))
    return all(set(lrs) <= set(after.get(opt, [])) for opt, lrs in before.items())


def read_study(path: Path, kind: str) -> dict:
    """The study.json that --from-tuning names: a study of `kind` with its table (a batch-scaling study's has no
    "kind"); a missing, unreadable, foreign or other kind's file is one sentence."""
    if not path.is_file():
        raise UserError(f"--from-tuning: {path} does not exist; give the --out of a finished tuning study.")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):   # unreadable, not UTF-8, not JSON (e.g. cut short)
        data = None
    if not isinstance(data, dict) or not isinstance(data.get("table"), dict):
        raise UserError(f"--from-tuning: {path} is not the study.json of a study (unreadable, or no table in it); "
                        "give the --out of a finished tuning study.")
    if data.get("kind", "batch-scaling") != kind:
        raise UserError(f"--from-tuning: {path} is from study {data.get('kind', 'batch-scaling')}, not study {kind}; "
                        f"give the --out of a study {kind} tuning run.")
    return data


def stored_settings(path: Path) -> dict:
    """OUT/study_settings.json of a study being resumed; unreadable (e.g. cut short) is one sentence."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a readable settings file; remove it to continue the study in {path.parent} "
                        "with these arguments (its finished cells are kept), or use another --out.")
    return data


# What a tuning study's protocol is: studies that extend one another (more lr values, more batches) must agree here.
TUNING_PROTOCOL = ("recipe", "epochs", "nproc_per_node", "micro_batch", "overrides", "opt_set", "val_split")


def _tuning_rows(tuning_json: Path) -> tuple[dict, list[tuple[int, str, float, float | None]]]:
    """A tuning study's study.json and its table as (batch, optimizer, mean validation top-1, lr) rows."""
    data = read_study(tuning_json, "batch-scaling")
    if not data.get("val_split"):
        raise UserError(f"--from-tuning: {tuning_json} was not run with --val-split, so its choices saw the test "
                        "set; tune with --val-split N first.")
    try:
        rows = [(row["batch"], row["optimizer"], row["top1_mean"], row.get("lr")) for row in data["table"].values()]
    except (KeyError, TypeError, AttributeError):
        raise UserError(f"--from-tuning: {tuning_json} has a table row without batch, optimizer or top1_mean; give "
                        "the --out of a finished tuning study.") from None
    for key, (batch, opt, top1, lr) in zip(data["table"], rows):
        bad = next(((name, value, want) for name, value, ok, want in (
            ("batch", batch, _is_int(batch) and batch >= 1, "a positive whole number"),
            ("optimizer", opt, isinstance(opt, str), "an optimizer's name"),
            ("top1_mean", top1, _is_number(top1) and 0 <= top1 <= 1, "a top-1 between 0 and 1"),
            ("lr", lr, lr is None or (_is_number(lr) and lr > 0), "a positive number or null")) if not ok), None)
        if bad:
            raise UserError(f"--from-tuning: {tuning_json} has {bad[0]} {bad[1]!r} in its table row {key!r}, not "
                            f"{bad[2]}; restore that study.json from the tuning study's cells, or give the --out of "
                            "another tuning study.")
    return data, rows


def _is_number(value: object) -> bool:
    """A finite JSON number (bool is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _best(rows) -> dict[tuple[int, str], float | None]:
    best: dict[tuple[int, str], tuple[float, float | None]] = {}
    for batch, opt, top1, lr in rows:
        if (batch, opt) not in best or top1 > best[(batch, opt)][0]:   # ties: the first listed stands
            best[(batch, opt)] = (top1, lr)
    return {k: v[1] for k, v in best.items()}


def chosen_lrs(tuning_json: Path) -> dict[tuple[int, str], float | None]:
    """Each (batch, optimizer)'s lr with the best mean validation top-1 in a tuning study's study.json."""
    return _best(_tuning_rows(tuning_json)[1])


def chosen_lrs_of(tuning_outs: list[Path]) -> dict[tuple[int, str], float | None] | None:
    """The choices of all the --from-tuning studies together (None without one): each (batch, optimizer)'s lr
    with the best mean validation top-1 over every cell of them. So a tuning study is extended by another of
    the same protocol: a batch tuned later, or lr values beyond a grid's edge. A cell of a later study at the
    batch, optimizer and lr of an earlier one's replaces it: a re-run (e.g. after a fix) supersedes, so the order
    of the studies matters only there. Studies of different protocols (epochs, settings, validation split) are
    one sentence: their top-1s do not compare."""
    if not tuning_outs:
        return None
    rows: dict[tuple[int, str, float | None], tuple[int, str, float, float | None]] = {}
    first: tuple[Path, dict] | None = None
    for out in tuning_outs:
        data, more = _tuning_rows(out / "study.json")
        protocol = {k: data.get(k) for k in TUNING_PROTOCOL}
        if first is None:
            first = (out, protocol)
        elif protocol != first[1]:
            differ = ", ".join(k for k in TUNING_PROTOCOL if protocol[k] != first[1][k])
            raise UserError(f"--from-tuning: {first[0]} and {out} were tuned differently ({differ}), so their "
                            "validation top-1s do not compare; give tuning studies of one protocol.")
        for batch, opt, top1, lr in more:
            rows.pop((batch, opt, lr), None)            # a re-run replaces, and is listed where it was run
            rows[(batch, opt, lr)] = (batch, opt, top1, lr)
    return _best(rows.values())


def plan_cells(batches: list[int], optimizers: list[str], seeds: int, grid: dict[str, list[float]],
               chosen: dict[tuple[int, str], float | None] | None = None,
               only: set[tuple[int, str]] | None = None) -> list[tuple[int, str, float | None, int]]:
    """Step 1: (batch, optimizer, lr or None for the optimizer's setting, seed), seeds outermost so that a
    stopped study has whole seeds done; the lr comes from the grid, or from a tuning study's choice. `only`
    (`claim_cells`) keeps those (batch, optimizer) pairs of the grid."""
    cells = []
    for s in range(seeds):
        for b in batches:
            for o in optimizers:
                if only is not None and (b, o) not in only:
                    continue
                if chosen is not None:
                    if (b, o) not in chosen:
                        raise UserError(f"--from-tuning has no choice for {o} at batch {b}; tune that cell too.")
                    lrs: Sequence[float | None] = [chosen[(b, o)]]
                else:
                    lrs = grid.get(o) or [None]
                cells += [(b, o, lr, s) for lr in lrs]
    return cells


def _parse_list(text: str, what: str, cast, example: str = "256,1024") -> list:
    try:
        items = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--{what} {text!r} is not a comma-separated list; e.g. --{what} {example}.") from None
    if not items:
        raise UserError(f"--{what} is empty; give at least one value.")
    return items


def _yaml_value(v: object) -> str:
    return "null" if v is None else json.dumps(v) if not isinstance(v, str) else v


def cell_overrides(args, batch: int, opt: str, seed: int, lr: float | None = None) -> list[str]:
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
    if lr is not None:
        sets.append(f"optim.lr={lr:g}")
    if getattr(args, "val_split", None):
        sets.append(f"data.val_split={args.val_split}")
    return list(args.overrides) + sets


DIVERGED = "diverged.txt"   # a cell that diverged before summary.json had a status: done, with no top-1


def _cell_dir(out: Path, batch: int, opt: str, seed: int, lr: float | None = None) -> Path:
    return out / "runs" / (f"{opt}-b{batch}-s{seed}" if lr is None else f"{opt}-b{batch}-lr{lr:g}-s{seed}")


def _train_records(run_dir: Path) -> list[dict]:
    from largebatch.metrics import read

    return [r for r in read(run_dir / "metrics.jsonl") if r.get("kind") == "train"]


def _final_train_loss(run_dir: Path) -> float | None:
    recs = _train_records(run_dir)
    return recs[-1]["loss"] if recs else None


def _noise_scale(run_dir: Path) -> float | None:
    """B_simple of a run (`train.noise_scale`): sum tr(Sigma) / sum |G|^2 over the logged steps of the second half
    of training (a ratio of means, as McCandlish et al. average the two before dividing); None without them."""
    recs = [r for r in _train_records(run_dir) if r.get("grad_sq") is not None and r.get("grad_trace") is not None]
    if not recs:
        return None
    half = recs[-1]["epoch"] / 2
    late = [r for r in recs if r["epoch"] >= half]
    g2 = sum(r["grad_sq"] for r in late)
    return sum(r["grad_trace"] for r in late) / g2 if g2 > 0 else None


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation over seeds (0 for one seed): every study's table uses it."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0


def summarise(cells: list[dict]) -> dict:
    """Mean and spread (sample std; 0 for one seed) of top-1 and final train loss per (batch, optimizer, lr);
    with an lr axis, `chosen` marks each (batch, optimizer)'s lr of the best mean top-1."""
    groups: dict[tuple[int, str, float | None], list[dict]] = {}
    for c in cells:
        if c.get("top1") is not None:
            groups.setdefault((c["batch"], c["optimizer"], c.get("lr")), []).append(c)
    table: dict[str, dict[str, Any]] = {}
    for (b, o, lr), cs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0.0)):
        top1 = [c["top1"] for c in cs]
        losses = [c["train_loss"] for c in cs if c.get("train_loss") is not None]
        mean, std = mean_std(top1)
        key = f"{o}@{b}" if lr is None else f"{o}@{b}/lr{lr:g}"
        noise = [c["noise_scale"] for c in cs if c.get("noise_scale") is not None]
        table[key] = {"batch": b, "optimizer": o, "lr": lr, "top1_mean": mean, "top1_std": std, "seeds": len(top1),
                      "train_loss_mean": sum(losses) / len(losses) if losses else None,
                      "noise_scale_mean": sum(noise) / len(noise) if noise else None}
    best: dict[tuple[int, str], str] = {}
    for key, row in table.items():
        k = (row["batch"], row["optimizer"])
        if k not in best or row["top1_mean"] > table[best[k]]["top1_mean"]:
            best[k] = key
    diverged: dict[tuple[int, str], list[float]] = {}
    for c in cells:
        if c.get("diverged") and c.get("lr") is not None:
            diverged.setdefault((c["batch"], c["optimizer"]), []).append(c["lr"])
    for key, row in table.items():
        row["chosen"] = best[(row["batch"], row["optimizer"])] == key
        row["diverged_lrs"] = sorted(set(diverged.get((row["batch"], row["optimizer"]), [])))
    return table


def markdown(table: dict, batches: list[int], optimizers: list[str], split: str = "test") -> str:
    """One row per global batch; per optimizer the chosen lr's top-1 (mean ± std over seeds) and train loss."""
    head = "| global batch | " + " | ".join(f"{o} {split} top-1 (%) | {o} lr | {o} train loss"
                                            for o in optimizers) + " |"
    sep = "|---:|" + "---:|---:|---:|" * len(optimizers)
    rows = [head, sep]
    for b in batches:
        cols = []
        for o in optimizers:
            c = next((r for r in table.values() if r["batch"] == b and r["optimizer"] == o and r["chosen"]), None)
            if c is None:
                cols += ["(not run)", "", ""]
            else:
                gone = c.get("diverged_lrs", [])
                lrs = sorted({r["lr"] for r in table.values() if r["batch"] == b and r["optimizer"] == o
                              and r["lr"] is not None} | set(gone))
                tried = len(lrs)
                edge = tried > 1 and c["lr"] in (lrs[0], lrs[-1])   # the optimum may lie outside the grid
                cols.append(f"{100 * c['top1_mean']:.2f} ± {100 * c['top1_std']:.2f} (n={c['seeds']})")
                notes = [f"best of {tried}"] + ([f"{len(gone)} diverged"] if gone else []) + (["at the edge"] if edge else [])
                cols.append("setting" if c["lr"] is None else f"{c['lr']:g}" + (
                    f" ({', '.join(notes)})" if tried > 1 else ""))
                cols.append(f"{c['train_loss_mean']:.3f}" if c["train_loss_mean"] is not None else "")
        rows.append(f"| {b} | " + " | ".join(cols) + " |")
    noise = {(r["batch"], r["optimizer"]): r["noise_scale_mean"] for r in table.values()
             if r["chosen"] and r.get("noise_scale_mean") is not None}
    if noise:
        rows += ["", "Gradient noise scale B_simple (second half of training, chosen lr; the batch above which a "
                 "larger batch stops paying, McCandlish et al.):", "",
                 "| global batch | " + " | ".join(f"{o} B_simple" for o in optimizers) + " |",
                 "|---:|" + "---:|" * len(optimizers)]
        for b in batches:
            rows.append(f"| {b} | " + " | ".join(f"{noise[(b, o)]:,.0f}" if (b, o) in noise else ""
                                                  for o in optimizers) + " |")
    return "\n".join(rows) + "\n"


IMAGENET_IMAGES = 1_281_167


def plot(table: dict, optimizers: list[str], path: Path, train_size: int | None = None, split: str = "test") -> None:
    """Top-1 (chosen lr per cell) against the global batch on a log2 axis, error bars over seeds; with
    `train_size`, the ImageNet batch with the same steps per epoch on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for o in optimizers:
        pts = sorted((c["batch"], c["top1_mean"], c["top1_std"]) for c in table.values()
                     if c["optimizer"] == o and c.get("chosen", True))
        if pts:
            xs, ys, es = zip(*pts)
            ax.errorbar(xs, [100 * y for y in ys], yerr=[100 * e for e in es], marker="o", capsize=3, label=o)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch (images)")
    ax.set_ylabel(f"{split} top-1 (%)")
    if train_size:
        import numpy as np
        from matplotlib.ticker import NullFormatter

        scale = IMAGENET_IMAGES / train_size
        top = ax.secondary_xaxis("top", functions=(lambda b: np.multiply(b, scale), lambda b: np.divide(b, scale)))
        batches = sorted({c["batch"] for c in table.values()})
        top.set_xticks([b * scale for b in batches], [f"{b * scale / 1000:.3g}K" for b in batches])
        top.xaxis.set_minor_formatter(NullFormatter())
        top.set_xlabel("ImageNet-equivalent batch (same steps per epoch)")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_title("top-1 vs global batch at equal epochs")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def save_figure(fig, path: Path) -> None:
    """A figure as PNG, written whole or not at all."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    write_file(path, buf.getvalue())


def write_file(path: Path, data: str | bytes) -> None:
    """Step 4: one of the study's files, written whole or not at all (a kill or a full disk leaves the old one)."""
    from largebatch.checkpoint import atomic_write

    atomic_write(path, data.encode() if isinstance(data, str) else data)


def _check_cells(args, pairs: list[tuple[int, str]]) -> int:
    """Step 2: every planned (batch, optimizer)'s plan resolves (divisibility, batch vs dataset size) before
    anything trains; the training images per cell."""
    from largebatch import config as config_mod
    from largebatch.commands.train import _train_size, dry_run

    base = config_mod.load(args.recipe, cell_overrides(args, *pairs[0], 0))
    size, _ = _train_size(base)
    whole = size + (args.val_split or 0)   # data.train_size counts the images before the split
    for b, o in pairs:
        cfg = config_mod.load(args.recipe, cell_overrides(args, b, o, 0) + [f"data.train_size={whole}"])
        dry_run(cfg, args.nproc_per_node)
    return size


# The papers' claims in Fashion-MNIST batches (x 1,281,167 / 60,000 = the ImageNet batch with the same steps per
# epoch): (who, claim, optimizer, batch, "within" | "below", points against the baseline, SGD at the smallest batch).
CLAIMS = (
    ("Goyal et al.", "SGD at ImageNet 8K within 1.0 point of the small-batch baseline", "sgd", 384, "within", 1.0),
    ("Goyal et al.", "SGD breaks at ImageNet 64K: more than 1.0 point below", "sgd", 3072, "below", 1.0),
    ("You et al.", "LARS at ImageNet 32K within 1.0 point of the small-batch baseline", "lars", 1536, "within", 1.0),
    ("You et al. (LAMB)", "LAMB at ImageNet 32K within 1.0 point of the small-batch baseline", "lamb", 1536,
     "within", 1.0),
)


def claim_cells(batches: list[int], optimizers: list[str]) -> set[tuple[int, str]]:
    """Step 1, --claims-only: the (batch, optimizer) pairs `claims` reads, of those given: SGD at the smallest
    batch, the baseline, and each claim's cell. Without the baseline or any claim's cell, one sentence."""
    if "sgd" not in optimizers:
        raise UserError("--claims-only measures every claim against SGD at the smallest batch; add sgd to "
                        "--optimizers.")
    base = min(batches)
    pairs = {(batch, opt) for _, _, opt, batch, _, _ in CLAIMS if batch in batches and opt in optimizers
             and batch != base}
    if not pairs:
        known = ", ".join(f"{opt} at {batch}" for _, _, opt, batch, _, _ in CLAIMS)
        raise UserError(f"--claims-only: no claim's cell is in --batches and --optimizers; the claims read {known}, "
                        f"each against sgd at the smallest batch.")
    return pairs | {(base, "sgd")}


def claims(table: dict) -> list[dict]:
    """Each claim of `CLAIMS` whose cells ran: the measured difference (chosen lr, mean over seeds) against the
    baseline, SGD at the smallest batch, and whether it held. The spread is the larger of the two seeds' standard
    deviations; with one seed a verdict is marked as such."""
    chosen = {(r["batch"], r["optimizer"]): r for r in table.values() if r["chosen"]}
    sgd = sorted(b for b, o in chosen if o == "sgd")
    if not sgd:
        return []
    base = chosen[(sgd[0], "sgd")]
    out = []
    for who, claim, opt, batch, kind, points in CLAIMS:
        row = chosen.get((batch, opt))
        if row is None or batch == base["batch"]:
            continue
        diff = row["top1_mean"] - base["top1_mean"]
        held = diff >= -points / 100 if kind == "within" else diff < -points / 100
        out.append({"who": who, "claim": claim, "batch": batch, "optimizer": opt, "top1": row["top1_mean"],
                    "baseline_top1": base["top1_mean"], "baseline_batch": base["batch"], "difference": diff,
                    "spread": max(row["top1_std"], base["top1_std"]), "seeds": min(row["seeds"], base["seeds"]),
                    "held": held})
    return out


def claims_markdown(rows: list[dict], split: str) -> str:
    if not rows:
        return ""
    lines = ["", f"The papers' claims ({split} top-1, chosen lr, against SGD at batch {rows[0]['baseline_batch']}):", "",
             "| claim | measured | difference (points) | held |", "|---|---:|---:|---|"]
    for r in rows:
        verdict = ("held" if r["held"] else "did not hold") + (" (1 seed)" if r["seeds"] < 2 else "")
        lines.append(f"| {r['who']}: {r['claim']} | {r['optimizer']} at {r['batch']}: {100 * r['top1']:.2f} "
                     f"(baseline {100 * r['baseline_top1']:.2f}) | {100 * r['difference']:+.2f} "
                     f"± {100 * r['spread']:.2f} | {verdict} |")
    return "\n".join(lines) + "\n"


def earlier_machines(out: Path) -> dict[str, str]:
    """Each finished cell's machine as OUT/study.json gave it before this run of the study rewrites it: a cell
    finished before summary.json named its machine has the one that ran the study then (each study.json is
    written after every cell by the machine running the study)."""
    path = out / "study.json"
    if not path.exists():
        return {}
    fix = ("move it away (the study writes it anew from its cells' summary.json files), or restore it, or use "
           "another --out")
    try:
        earlier = json.loads(path.read_bytes())
    except (OSError, ValueError):   # unreadable, not UTF-8, not JSON (e.g. cut short)
        raise UserError(f"{path} is not readable JSON (cut short or edited?); {fix}.") from None
    cells = earlier.get("cells", []) if isinstance(earlier, dict) else None
    if not isinstance(cells, list) or not all(
            isinstance(c, dict) and isinstance(c.get("run_dir", ""), str)
            and isinstance(c.get("machine") or "", str) and (c.get("top1") is None or _is_number(c["top1"]))
            for c in cells) or not isinstance(earlier.get("machine") or "", str):
        raise UserError(f"{path} is not a study's study.json (its cells are not a list of cells with run_dir, top1 "
                        f"and machine); {fix}.")
    return {c["run_dir"]: name for c in cells
            if c.get("top1") is not None and "run_dir" in c and (name := c.get("machine") or earlier.get("machine"))}


def machines(cells: list[dict]) -> str:
    """The machines the finished cells ran on, in words: one, or each with its number of cells (a resumed study
    may move)."""
    counts: dict[str, int] = {}
    for c in cells:
        if c.get("top1") is not None:
            name = c.get("machine") or "not recorded"
            counts[name] = counts.get(name, 0) + 1
    if len(counts) <= 1:
        return f"machine: {next(iter(counts), 'none yet')}"
    return "machines (each cell's in study.json): " + "; ".join(
        f"{m}, {n} cell{'s' if n > 1 else ''}" for m, n in counts.items())


def machine_time(cells: list[dict]) -> str:
    """The machine time the finished cells took: the sum of their training + evaluation wall times."""
    seconds = sum(c.get("wall_s") or 0.0 for c in cells)
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def write_outputs(out: Path, meta: dict, cells: list[dict], batches: list[int], optimizers: list[str]) -> dict:
    """Step 4."""
    table = summarise(cells)
    batches = sorted(batches)
    split = "validation" if meta.get("val_split") else "test"
    verdicts = claims(table)
    write_file(out / "study.json", json.dumps({**meta, "cells": cells, "table": table, "claims": verdicts}, indent=2))
    md = (f"Command: `{meta['command']}`\n\nEpochs per cell: {meta['epochs']}, seeds: {meta['seeds']}, "
          f"workers per cell: {meta['nproc_per_node']}, evaluated on the {split} set, {machines(cells)}, "
          f"machine time of the finished cells: {machine_time(cells)}\n\n" + markdown(table, batches, optimizers, split)
          + claims_markdown(verdicts, split))
    write_file(out / "study.md", md)
    if table:
        plot(table, optimizers, out / "study.png", meta.get("train_size"), split)
    return table


SETTINGS = "study_settings.json"   # step 5: the file that marks a directory as a study's
STUDY_FILES = (SETTINGS, "study.json", "study.md", "study.png", rundir.LOCK)


def check_out(out: Path) -> None:
    """Step 5: refuse a --out that is not the study's to take, in one sentence naming the fix: a system or home
    directory, a file, a directory that holds a training run, and one of other files (a user's own study.md,
    a project) that no study_settings.json marks as a study's; a caller's *.log is no obstacle."""
    check_output_path("--out", out, directory=True)
    refuse_system(out, "--out")
    if not out.is_dir():
        return
    if rundir.holds_run(out):
        found = ", ".join(n for n in rundir.RUN_FILES if (out / n).exists()) or "checkpoints or snapshots"
        raise UserError(f"--out {out} holds a training run ({found}); give the study a directory of its own, e.g. "
                        "runs/study-NAME.")
    if (out / SETTINGS).is_file() and not (out / SETTINGS).is_symlink():
        return   # a study's: continued; files of others in it are left alone
    with os.scandir(out) as entries:
        foreign = sorted(e.name for e in entries if e.name != rundir.LOCK
                         and not (Path(e.name).match(rundir.CALLER_LOGS) and e.is_file(follow_symlinks=False)))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(f"--out {out} holds files that are not a largebatch study's ({shown}) and no {SETTINGS}; "
                        "give a new or empty --out, so that the study neither mixes its files with them nor writes "
                        "over them.")


def take_out(out: Path, dry_run: bool):
    """Step 5: check --out, then (not in a dry run) create it and hold its lock until the study ends; the
    rundir.Claim, None in a dry run."""
    check_out(out)
    if dry_run:   # a dry run writes nothing: it only lists the cells and checks the settings
        return None
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create study directory {out}: {exc.strerror}; give an --out you can write to.") \
            from None
    held = rundir.lock(out, "study directory", "--out")
    try:
        check_out(out)   # again under the lock: a study that ended a moment ago may have written it
    except UserError:
        held.release()
        raise
    return held


def read_summary(path: Path) -> dict:
    """Step 6: a finished cell's summary.json, its numbers checked; damaged or edited is one sentence."""
    fix = ("restore it, or move it away and run the study again (the cell resumes from its newest checkpoint); "
           "the study has not started a cell")
    try:
        summ = json.loads(path.read_bytes())
    except (OSError, ValueError):
        raise UserError(f"{path} is not readable JSON (cut short or edited?); {fix}.") from None
    if not isinstance(summ, dict):
        raise UserError(f"{path} is not a run's summary (a JSON {type(summ).__name__}); {fix}.")
    status = summ.setdefault("status", "finished")   # summaries written before the status were of finished runs
    if status not in STATUSES:
        raise UserError(f"{path} has status {status!r}, not one of {', '.join(STATUSES)}; {fix}.")
    if status == "diverged":   # no evaluation: the trainer's sentence and where it stopped
        return summ
    need = {"final_top1": "a top-1 between 0 and 1", "final_top5": "a top-5 between 0 and 1",
            "final_loss": "a number", "steps": "a whole number of steps", "wall_s": "seconds", "epochs": "epochs"}
    optional = ("ensemble_top1", "best_snapshot_top1", "ensemble_gain", "swa_top1")
    for key in (*need, *optional):
        if key not in need and key not in summ:
            continue
        value: Any = summ.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)   # a loss may be inf or nan
        if ok and key in ("final_top1", "final_top5"):
            ok = _is_number(value) and 0 <= value <= 1
        elif ok and key == "steps":
            ok = _is_int(value) and value >= 0
        if not ok:
            raise UserError(f"{path} has {key} {value!r}, not {need.get(key, 'a number')}; {fix}.")
    if not isinstance(summ.get("machine") or "", str):
        raise UserError(f"{path} has machine {summ['machine']!r}, not a machine's name; {fix}.")
    return summ


class Stop:
    """Step 5: SIGTERM and SIGINT to the study set `signum` and are forwarded to the running cell's process group
    (its launcher and workers, or its one process, started in a session of their own), which stops at the next
    step with a checkpoint."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.group: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        self.forward()

    def forward(self) -> None:
        if self.group is not None and self.signum is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.group, self.signum)


def check_files(out: Path, cell_dirs: list[Path]) -> dict[str, str]:
    """Step 6: OUT/study.json and every planned cell's summary.json are readable and of their shape (one sentence
    naming the file otherwise); the earlier machines of OUT/study.json (`earlier_machines`)."""
    earlier = earlier_machines(out)
    for run_dir in cell_dirs:
        if (run_dir / "summary.json").exists():
            read_summary(run_dir / "summary.json")
    return earlier


def stopped(out: Path, signum: int, console, held) -> int:
    """Step 5: the study was signalled; its files are written, the interrupted cell resumes on the next run."""
    console.print(f"study: stopped by signal {signum}; run the same command again to continue (finished cells are "
                  f"kept, the interrupted one resumes from its checkpoint); results so far in {out / 'study.json'}")
    if held is not None:
        held.release()
    return 128 + signum


def run_cell(args, run_dir: Path, sets: list[str], label: str, position: str, console,
             earlier: dict[str, str] | None = None, stop: Stop | None = None) -> dict:
    """Step 3 for one cell: train it unless its summary exists (resume it if it holds a run), then its record:
    the exact command, and from its summary top-1/top-5, losses, steps, wall time, machine (`earlier`'s for a
    summary without one) and ensemble figures. With `stop`, a signal to the study stops the cell (step 5): its
    record says interrupted."""
    summary_path = run_dir / "summary.json"
    diverged_path = run_dir / DIVERGED   # the marker of cells run before summary.json had a status
    argv = ["train", args.recipe, "--nproc-per-node", str(args.nproc_per_node), "--run-dir", str(run_dir),
            *[x for kv in sets for x in ("--set", kv)]]
    command = " ".join(shlex.quote(c) for c in ["largebatch", *argv])
    interrupted = False
    summ = read_summary(summary_path) if summary_path.exists() else None
    if summ is None and not diverged_path.exists():
        resume = rundir.holds_run(run_dir)   # a cell interrupted at any point continues where it was
        console.print(f"[bold]study[/] cell {position}: {label}{' (resuming)' if resume else ''}")
        if args.dry_run:   # the exact command, so that one cell can be run by hand
            console.print(f"  {command}", markup=False, highlight=False, soft_wrap=True)
        else:
            t0 = time.perf_counter()
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "largebatch", *argv, "--quiet"] + (["--resume"] if resume else [])
            with open(run_dir / "train.log", "a") as log:
                # a session of its own: a signal to the study reaches the cell only through `stop` (step 5)
                env = {**os.environ, STUDY_PID: str(os.getpid())}   # a killed study takes its cell with it
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=stop is not None)
                if stop is not None:
                    stop.group = proc.pid
                    stop.forward()   # a signal that came before the group was known
                try:
                    proc.wait()
                finally:
                    if stop is not None:
                        stop.group = None
            summ = read_summary(summary_path) if summary_path.exists() else None
            status = summ["status"] if summ is not None else None
            if stop is not None and stop.signum is not None and status is None:
                interrupted = True
                console.print(f"study: cell {label} stopped by signal {stop.signum} with a checkpoint; it resumes "
                              "when the study is run again")
            elif status == "diverged":   # a result, not a failure: this lr is too large here
                console.print(f"study: {label} diverged")
            elif status == "finished" and stop is not None and stop.signum is not None:
                # the signal reached the cell after it wrote its summary (its launcher may then exit 128 + signum)
                console.print(f"study: {label} done in {time.perf_counter() - t0:.0f} s, before signal {stop.signum} "
                              "reached it")
            elif proc.returncode != 0:
                console.print(f"[red]study: cell {label} failed (exit {proc.returncode}); see {run_dir / 'train.log'}[/]")
            else:
                console.print(f"study: {label} done in {time.perf_counter() - t0:.0f} s")
    status = summ["status"] if summ is not None else "diverged" if diverged_path.exists() else None
    cell: dict[str, Any] = {"run_dir": str(run_dir), "top1": None, "diverged": status == "diverged",
                            "command": command}
    if interrupted:
        cell["interrupted"] = True
    if summ is not None and status == "finished":
        cell.update({"top1": summ["final_top1"], "top5": summ["final_top5"], "test_loss": summ["final_loss"],
                     "train_loss": _final_train_loss(run_dir), "steps": summ["steps"], "wall_s": summ["wall_s"],
                     "epochs": summ["epochs"], "noise_scale": _noise_scale(run_dir),
                     "machine": summ.get("machine") or (earlier or {}).get(str(run_dir))})
        for key in ("ensemble_top1", "best_snapshot_top1", "ensemble_gain", "swa_top1"):
            if key in summ:
                cell[key] = summ[key]
    return cell


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    batches = _parse_list(args.batches, "batches", int)
    optimizers = _parse_list(args.optimizers, "optimizers", str)
    bad = [o for o in optimizers if o not in OPTIMIZER_SETTINGS]
    if bad:
        raise UserError(f"--optimizers has {bad}; choose from {', '.join(OPTIMIZER_SETTINGS)}.")
    check_numbers(*((flag, value, value >= 1, "1 or more") for flag, value in (
        ("--seeds", args.seeds), ("--nproc-per-node", args.nproc_per_node), ("--micro-batch", args.micro_batch))))
    if args.epochs is not None and not 0 < args.epochs <= MAX_EPOCHS:   # nan fails both
        raise UserError(f"--epochs is {args.epochs}; give a positive number of epochs (at most {MAX_EPOCHS:,}).")
    check_numbers(*[("--batches", b, b >= 1, "positive global batches") for b in batches])
    grid = lr_grid(args.lr_grid, optimizers)
    if args.val_split is not None and args.val_split < 1:
        raise UserError(f"--val-split is {args.val_split}; give a number of held-out training images.")
    if args.from_tuning and (grid or args.val_split):
        raise UserError("--from-tuning runs the chosen settings on the test set; leave out --lr-grid and --val-split.")
    chosen = chosen_lrs_of(args.from_tuning)
    only = claim_cells(batches, optimizers) if args.claims_only else None
    plan = plan_cells(batches, optimizers, args.seeds, grid, chosen, only)
    train_size = _check_cells(args, list(dict.fromkeys((b, o) for b, o, _, _ in plan)))

    from rich.console import Console

    console = Console(stderr=True)
    held = take_out(args.out, args.dry_run)
    try:
        settings = {"recipe": args.recipe, "epochs": args.epochs, "nproc_per_node": args.nproc_per_node,
                    "micro_batch": args.micro_batch, "overrides": args.overrides, "opt_set": args.opt_set,
                    "lr_grid": args.lr_grid, "val_split": args.val_split,
                    "from_tuning": ", ".join(map(str, args.from_tuning)) or None}
        stored = args.out / SETTINGS
        if stored.exists() and not same_study(stored_settings(stored), settings, optimizers):
            raise UserError(f"{args.out} holds a study with other settings ({stored}); resume it with the same "
                            "--recipe/--epochs/--set/--opt-set/--micro-batch/--nproc-per-node (an --lr-grid may only "
                            "add values), or use another --out.")
        cell_dirs = [_cell_dir(args.out, b, o, s, lr) for b, o, lr, s in plan]
        earlier = check_files(args.out, cell_dirs)   # step 6: before any cell trains (and before anything is written)
        if not args.dry_run:
            write_file(stored, json.dumps(settings, indent=2))
        from largebatch.commands.bench import machine
        import torch

        meta = {"command": "largebatch study batch-scaling " + " ".join(argv), **settings, "seeds": args.seeds,
                "batches": batches, "optimizers": optimizers, "claims_only": args.claims_only, "train_size": train_size,
                "machine": machine(torch.device("cpu"))}

        cells: list[dict] = []
        stop = None if args.dry_run else Stop()
        if stop is not None:
            stop.install()
        for i, ((b, o, lr, s), run_dir) in enumerate(zip(plan, cell_dirs)):
            if stop is not None and stop.signum is not None:
                break
            label = f"{o} batch {b}{'' if lr is None else f' lr {lr:g}'} seed {s}"
            cell = {"batch": b, "optimizer": o, "lr": lr, "seed": s,
                    **run_cell(args, run_dir, cell_overrides(args, b, o, s, lr), label, f"{i + 1}/{len(plan)}", console,
                             earlier, stop)}
            cells.append(cell)
            if not args.dry_run:
                write_outputs(args.out, meta, cells, batches, optimizers)
        table = summarise(cells) if args.dry_run else write_outputs(args.out, meta, cells, batches, optimizers)
        if stop is not None and stop.signum is not None:
            return stopped(args.out, stop.signum, console, held)
        console.print(markdown(table, sorted(batches), optimizers))
        if args.dry_run:
            console.print(f"study: dry run, {len(cells)} cells listed; nothing written to {args.out}")
            return 0
        diverged = sum(bool(c.get("diverged")) for c in cells)
        console.print(f"study: {sum(c['top1'] is not None for c in cells)}/{len(cells)} cells done"
                      f"{f', {diverged} diverged' if diverged else ''} in {machine_time(cells)} of training; results in "
                      f"{args.out / 'study.md'}, {args.out / 'study.json'}, {args.out / 'study.png'}")
        return 0
    finally:   # an error or a stop after --out was taken releases it too (the flock of this process)
        if held is not None:
            held.release()
