"""--from-tuning: a final study takes each group's lr from the tuning studies that chose it, never from the test set.

A tuning study (--lr-grid with --val-split) evaluates every cell on held-out training images; its study.json's
table gives each group's mean validation top-1 per lr. A final study names one or more (batch-scaling: repeatable)
and runs each group at the lr of the best mean validation top-1 over all their rows (`summary.chosen_lrs`, the one
choice every table makes). Tuning studies of one protocol extend each other: a batch tuned later, lr values past a
grid's edge; a row of a later study at the group and lr of an earlier one's replaces it (a re-run after a fix).
Every file is checked before any cell trains: a missing, unreadable, foreign or other kind's study.json, or a row
of the wrong type, is one sentence naming it.
"""
from __future__ import annotations

import json
from pathlib import Path

from largebatch.commands.study.cells import is_int, is_number
from largebatch.commands.study.summary import chosen_lrs
from largebatch.errors import UserError

# What a tuning study's protocol is: studies that extend one another (more lr values, more batches) must agree here.
TUNING_PROTOCOL = ("recipe", "epochs", "nproc_per_node", "micro_batch", "overrides", "opt_set", "val_split", "protocol")

# What each group field of a tuning table's row must be.
FIELDS = {"batch": (lambda v: is_int(v) and v >= 1, "a positive whole number"),
          "optimizer": (lambda v: isinstance(v, str), "an optimizer's name")}

Row = tuple[tuple, float, float | None]


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


def tuning_rows(path: Path, kind) -> tuple[dict, list[Row]]:
    """A tuning study's study.json and its table as (group, mean validation top-1, lr) rows. The group is a row's
    fields where the table has a row per group and lr (batch-scaling), else the row's name (a variant)."""
    data = read_study(path, kind.name)
    if not data.get("val_split"):
        raise UserError(f"--from-tuning: {path} was not run with --val-split, so its choices saw the test "
                        "set; tune with --val-split N first.")
    fields = kind.axes if kind.every_lr else ()
    table = {key: row for key, row in data["table"].items() if key != "verdict"}
    try:
        rows = [(tuple(row[a] for a in fields) or (key,), row["top1_mean"], row.get("lr"))
                for key, row in table.items()]
    except (KeyError, TypeError, AttributeError):
        need = ", ".join(fields) + " or " if fields else ""
        raise UserError(f"--from-tuning: {path} has a table row without {need}top1_mean; give the --out of a "
                        "finished tuning study.") from None
    for key, (group, top1, lr) in zip(table, rows):
        checks = [(a, v, *FIELDS[a]) for a, v in zip(fields, group)] + [
            ("top1_mean", top1, lambda v: is_number(v) and 0 <= v <= 1, "a top-1 between 0 and 1"),
            ("lr", lr, lambda v: v is None or (is_number(v) and v > 0), "a positive number or null")]
        bad = next(((name, value, want) for name, value, ok, want in checks if not ok(value)), None)
        if bad:
            raise UserError(f"--from-tuning: {path} has {bad[0]} {bad[1]!r} {kind.row_word} {key!r}, not "
                            f"{bad[2]}; restore that study.json from the tuning study's cells, or give the --out of "
                            "another tuning study.")
    return data, rows


def chosen_lrs_of(tuning_outs: list[Path], kind) -> dict[tuple, float | None] | None:
    """The choices of all the --from-tuning studies together (None without one): each group's lr with the best
    mean validation top-1 over every row of them. A row of a later study at the group and lr of an earlier one's
    replaces it: a re-run (e.g. after a fix) supersedes, so the order of the studies matters only there. Studies
    of different protocols (epochs, settings, validation split) are one sentence: their top-1s do not compare."""
    if not tuning_outs:
        return None
    rows: dict[tuple, Row] = {}
    first: tuple[Path, dict] | None = None
    for out in tuning_outs:
        data, more = tuning_rows(out / "study.json", kind)
        protocol = {k: data.get(k) for k in TUNING_PROTOCOL}
        if first is None:
            first = (out, protocol)
        elif protocol != first[1]:
            differ = ", ".join(k for k in TUNING_PROTOCOL if protocol[k] != first[1][k])
            raise UserError(f"--from-tuning: {first[0]} and {out} were tuned differently ({differ}), so their "
                            "validation top-1s do not compare; give tuning studies of one protocol.")
        for group, top1, lr in more:
            rows.pop((group, lr), None)            # a re-run replaces, and is listed where it was run
            rows[(group, lr)] = (group, top1, lr)
    return chosen_lrs(rows.values())
