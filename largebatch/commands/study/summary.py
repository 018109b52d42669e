"""Step 4 of a study: its table, the lr it chooses per group and its files, one summariser for every kind.

After every cell the study writes OUT/study.json (all cells, each with its exact `largebatch train` command, the
table and the verdicts), OUT/study.md (the table, mean ± sample std over seeds, and the claims) and OUT/study.png,
each whole or not at all. Written again from a committed study.json's own head and cells, they are the committed
files (tests/integration/test_study.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

from largebatch.commands.study.directory import write_file
from largebatch.commands.study.verdict import judge


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation over seeds (0 for one seed): every study's table uses it."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0


def chosen_lrs(rows: Iterable[tuple[tuple, float, float | None]]) -> dict[tuple, float | None]:
    """The one choice of every table and of --from-tuning: each group's lr with the best mean top-1 over its
    (group, mean top-1, lr) rows; ties: the first listed stands."""
    best: dict[tuple, tuple[float, float | None]] = {}
    for group, top1, lr in rows:
        if group not in best or top1 > best[group][0]:
            best[group] = (top1, lr)
    return {group: lr for group, (_, lr) in best.items()}


def _row(kind, group: tuple, lr: float | None, done: list[dict]) -> dict[str, Any]:
    """Step 2 of `summarise`: one group's finished cells at one lr."""
    fields = dict(zip(kind.axes, group))
    variant = fields.get("variant")
    top1 = kind.top1.get(variant, "top1")
    mean, std = mean_std([c.get(top1, c["top1"]) for c in done])
    row = {**fields, "lr": lr, "top1_mean": mean, "top1_std": std, "seeds": len(done)}
    for f in kind.figures:
        values = [c[f.cell] for c in done if c.get(f.cell) is not None]
        if f.variant not in (None, variant):
            continue
        if not f.spread:
            row[f"{f.name}_mean"] = sum(values) / len(values) if values else None
        elif len(values) == len(done):
            row[f"{f.name}_mean"], row[f"{f.name}_std"] = mean_std(values)
    return row


def summarise(kind, cells: list[dict]) -> dict:
    """The table of a study of any kind:
    1. its finished cells by group (the kind's axes: batch and optimizer, or variant) and lr;
    2. per group and lr a row: mean ± sample std over seeds of the group's top-1 (the ensemble's own for the
       ensemble variant), the seeds, and the kind's figures (`protocol.FIGURES`);
    3. per group the chosen lr (`chosen_lrs`: the best mean, ties the lowest lr);
    4. in the kind's shape: with `every_lr` every row, keyed OPT@BATCH[/lrLR], marked chosen and with the group's
       diverged lrs; else the chosen row per group, keyed by its variant, with the lrs run and diverged, and the
       verdict of the kind's claim (`verdict.judge`) under "verdict"."""
    table: dict[str, Any] = {}
    for group in sorted({tuple(c[a] for a in kind.axes) for c in cells}):
        mine = [c for c in cells if tuple(c[a] for a in kind.axes) == group]
        rows = []
        for lr in sorted({c.get("lr") for c in mine}, key=lambda v: -1.0 if v is None else v):
            done = [c for c in mine if c.get("lr") == lr and c.get("top1") is not None]
            if done:
                rows.append(_row(kind, group, lr, done))
        if not rows:
            continue
        lr = chosen_lrs((group, r["top1_mean"], r["lr"]) for r in rows)[group]
        diverged = {c.get("lr") for c in mine if c.get("diverged")}
        if kind.every_lr:
            for r in rows:
                key = kind.row_key.format(**r) + ("" if r["lr"] is None else f"/lr{r['lr']:g}")
                table[key] = {**r, "chosen": r["lr"] == lr,
                              "diverged_lrs": sorted(v for v in diverged if v is not None)}
        else:
            row = next(r for r in rows if r["lr"] == lr)
            table[kind.row_key.format(**row)] = {**row, "lrs_run": len({c.get("lr") for c in mine}),
                                                 "lrs_diverged": len(diverged)}
    verdicts = [] if kind.claims_listed else judge(kind, table)
    if verdicts:   # a variant kind's one claim
        table["verdict"] = verdicts[0]
    return table


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


def tables(kind, meta: dict, cells: list[dict]) -> tuple[dict, str]:
    """study.json's data (the head `meta`, the cells, the table and, where the kind lists them, the claims'
    verdicts) and study.md's tables (the kind's `body`), also what the console shows at the end."""
    table = summarise(kind, cells)
    split = "validation" if meta.get("val_split") else "test"
    data = {**meta, "cells": cells, "table": table}
    verdicts = judge(kind, table) if kind.claims_listed else []
    if kind.claims_listed:
        data["claims"] = verdicts
    return data, kind.body(kind, table, meta, split, verdicts)


def write_outputs(out: Path, kind, meta: dict, cells: list[dict]) -> str:
    """OUT/study.json, OUT/study.md (the command, the kind's `header` line, the tables) and OUT/study.png (the
    kind's `chart`, once a cell has finished); study.md's tables."""
    data, body = tables(kind, meta, cells)
    write_file(out / "study.json", json.dumps(data, indent=2))
    used = machines(cells)
    head = kind.header.format(**{**meta, "split": "validation" if meta.get("val_split") else "test",
                                 "machines": used, "Machines": used[:1].upper() + used[1:],   # not .capitalize():
                                 "machine_time": machine_time(cells)})                      # it lowercases the CPU
    write_file(out / "study.md", f"Command: `{meta['command']}`\n\n{head}\n\n{body}")
    if any(key != "verdict" for key in data["table"]):
        kind.chart(kind, data["table"], cells, meta, out / "study.png")
    return body
