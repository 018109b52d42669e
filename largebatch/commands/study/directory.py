"""Step 5 of a study: its directory (OUT) belongs to one study process at a time, as a run directory does.

The study holds `fcntl.flock` on OUT/.largebatch.lock from its start to its end, and a second study on it is refused
naming the holder. A study takes an empty or new directory, or one its study_settings.json marks as a study's; a
directory that holds a training run or other files (a user's own study.md) is refused. A study resumed in its
directory must have the same settings (`same_study`). Its files are written whole or not at all (`write_file`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from largebatch import rundir
from largebatch.cli import check_output_path
from largebatch.commands.study.plan import lr_grid
from largebatch.errors import UserError
from largebatch.rundir import refuse_system

SETTINGS = "study_settings.json"   # the file that marks a directory as a study's


def check_out(out: Path) -> None:
    """Refuse a --out that is not the study's to take, in one sentence naming the fix: a system or home
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
    """Check --out, then (not in a dry run) create it and hold its lock until the study ends; the
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


def same_study(old: dict, new: dict, grid_names: list[str] | None = None) -> bool:
    """Whether `new` settings continue the study stored with `old`: everything equal, except that the lr grid
    may grow (an optimum at the grid's edge is extended without re-running the cells already done), and so may
    the list of --from-tuning studies, at its end (a cell tuned later or re-run: the cells whose choice it
    changes run at the new lr, the others are kept). `grid_names`: the grid is per name (--lr-grid OPT:A,B,
    repeatable, `study batch-scaling`); None: one grid for every variant (--lr-grid A,B)."""
    grows = ("lr_grid", "from_tuning")
    if {k: v for k, v in old.items() if k not in grows} != {k: v for k, v in new.items() if k not in grows}:
        return False
    tuned_before, tuned_after = old.get("from_tuning") or "", new.get("from_tuning") or ""
    if tuned_before and tuned_after != tuned_before and not tuned_after.startswith(tuned_before + ", "):
        return False
    if tuned_after and not tuned_before:   # a grid study does not become a final one
        return False
    before, after = lr_grid(old.get("lr_grid"), grid_names), lr_grid(new.get("lr_grid"), grid_names)
    return all(set(lrs) <= set(after.get(name, [])) for name, lrs in before.items())


def save_figure(fig, path: Path) -> None:
    """A figure as PNG, written whole or not at all."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    write_file(path, buf.getvalue())


def write_file(path: Path, data: str | bytes) -> None:
    """One of the study's files, written whole or not at all (a kill or a full disk leaves the old one)."""
    from largebatch.checkpoint import atomic_write

    atomic_write(path, data.encode() if isinstance(data, str) else data)
