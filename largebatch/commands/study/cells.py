"""Steps 3 and 5-6 of a study: each cell is a `largebatch train` of its own, and what the study reads back from it.

3. A cell runs as one process, or with --nproc-per-node 2 or more its own torchrun world, in its own run directory,
   forked from the study's forkserver, which imported torch once (`start_cell`).
   A cell with a summary.json is done (status finished or diverged: a result either way); a cell with checkpoints
   resumes from them, so an interrupted study continues where it stopped. Its record in study.json holds its exact
   command, so that one cell can be run again by hand.
5. SIGTERM and SIGINT to the study (`Stop`) are forwarded to the running cell's processes (a process group of their
   own), which stop at the next step with a checkpoint; the study waits for them, records the cell as interrupted
   (not failed) and exits 128 + the signal; run again, it resumes that cell. A cell that the signal reaches after it
   wrote its summary is done, with its result.
6. Files a user can edit or damage are checked before any cell trains, each refused in one sentence naming the
   file: OUT/study.json (`earlier_machines`) and every planned cell's summary.json (`read_summary`).
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
from typing import Any

from largebatch import rundir
from largebatch.commands.train import STUDY_PID
from largebatch.errors import UserError
from largebatch.rundir import STATUSES

DIVERGED = "diverged.txt"   # a cell that diverged before summary.json had a status: done, with no top-1


def is_number(value: object) -> bool:
    """A finite JSON number (bool is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
            ok = is_number(value) and 0 <= value <= 1
        elif ok and key == "steps":
            ok = is_int(value) and value >= 0
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


# Step 3: what a study's forkserver imports once before it forks each cell (not largebatch: it reads its environment
# when it imports); forkserver_session first, which puts the forkserver in a session of its own
CELL_PRELOAD = ("largebatch.forkserver_session", "numpy", "torch", "torch._dynamo", "torch.distributed.run")
_cells_forked = False   # this study started its cells' forkserver (`stop_cells`)


def start_cell(argv: list[str], log: Path, new_session: bool) -> Any:
    """Step 3: start the cell `largebatch ARGV`, its output (stdout and stderr) appended to LOG, in a session of its
    own where `new_session`; a handle with `pid`, `wait()` and `returncode` (negative: ended by that signal), as
    subprocess.Popen's. Warm: forked from the study's forkserver, which imported torch once (`CELL_PRELOAD`; itself
    a fork of the study where that is safe, `launch.fork_forkserver`, as a launch's is), and
    then `python -m largebatch ARGV` as a fresh interpreter runs it (`_warm_cell`): a cell does not spend the
    seconds a fresh interpreter takes to import torch. A cell watches the forkserver
    (LARGEBATCH_STUDY_PID; it ends when the study dies, its "alive" pipe). Cold, a fresh interpreter, where the
    forkserver's socket path would not fit (a TMPDIR over 64 characters) or it could not start."""
    global _cells_forked
    import multiprocessing
    import multiprocessing.forkserver as forkserver
    import tempfile

    server = None
    if len(tempfile.gettempdir()) <= 64:
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(CELL_PRELOAD))
        with contextlib.suppress(OSError):
            if not _cells_forked:   # a fork of this process where that is safe, else a fresh interpreter
                from largebatch.launch import fork_forkserver

                fork_forkserver()
            forkserver.ensure_running()
            _cells_forked = True
            server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if server is None:
        env = {**os.environ, STUDY_PID: str(os.getpid())}   # a killed study takes its cell with it
        with open(log, "a") as out:
            return subprocess.Popen([sys.executable, "-m", "largebatch", *argv], stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=new_session)
    env = {**os.environ, STUDY_PID: str(server)}   # the cell's parent, which ends with the study
    process = multiprocessing.get_context("forkserver").Process(
        target=_warm_cell, args=(argv, os.getcwd(), env, str(log), new_session), name="largebatch-cell")
    process.start()
    pid, deadline = int(process.pid or 0), time.monotonic() + 30
    while new_session and process.is_alive() and time.monotonic() < deadline:
        with contextlib.suppress(OSError):   # its own session before a signal is forwarded to its group
            if os.getsid(pid) == pid:
                break
        time.sleep(0.001)
    return _WarmCell(process)


class _WarmCell:
    """A cell forked from the study's forkserver, with Popen's `pid`, `wait()` and `returncode`."""

    def __init__(self, process) -> None:
        self.process, self.pid, self.returncode = process, process.pid, None

    def wait(self) -> int | None:
        self.process.join()
        self.returncode = self.process.exitcode
        return self.returncode


def _warm_cell(argv: list[str], cwd: str, env: dict[str, str], log: str, new_session: bool) -> None:
    """In the cell the study's forkserver forked: become `python -m largebatch ARGV` in CWD with ENV (as
    tests/cli_zygote.py's runs do), stdin /dev/null, stdout and stderr appended to LOG; never returns (the
    program ends with its own exit code, `cli.exit_now`)."""
    import runpy
    import tempfile
    import traceback

    code = 1
    try:
        if new_session:
            os.setsid()
        from largebatch.launch import drop_forkserver_fds

        drop_forkserver_fds()   # the forkserver then ends with the study, and the cell's launcher starts its own
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        stdin = os.open(os.devnull, os.O_RDONLY)
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        for fd, target in ((stdin, 0), (out, 1), (out, 2)):
            os.dup2(fd, target)
        os.close(stdin)
        os.close(out)
        if not getattr(sys.stdout, "write_through", True):   # a file, buffered as a fresh interpreter buffers it
            sys.stdout.reconfigure(line_buffering=False)   # type: ignore[union-attr]   # (unless -u)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        tempfile.tempdir = None   # TMPDIR as the cell's environment has it
        sys.path[0] = os.getcwd()   # python -m puts the working directory first
        sys.argv = ["-m", *argv]
        runpy._run_module_as_main("largebatch")   # type: ignore[attr-defined]  # what `python -m` calls
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:   # noqa: BLE001 - printed as python would
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def stop_cells() -> None:
    """The end of a study: its cells' forkserver (and multiprocessing's resource tracker) stopped and waited for."""
    global _cells_forked
    if _cells_forked:
        from largebatch.launch import stop_forkserver

        stop_forkserver(None)
        _cells_forked = False


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
            # a session of its own: a signal to the study reaches the cell only through `stop` (step 5)
            proc = start_cell([*argv, "--quiet"] + (["--resume"] if resume else []), run_dir / "train.log",
                              new_session=stop is not None)
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
                     "train_loss": final_train_loss(run_dir), "steps": summ["steps"], "wall_s": summ["wall_s"],
                     "epochs": summ["epochs"], "noise_scale": noise_scale(run_dir),
                     "machine": summ.get("machine") or (earlier or {}).get(str(run_dir))})
        for key in ("ensemble_top1", "best_snapshot_top1", "ensemble_gain", "swa_top1"):
            if key in summ:
                cell[key] = summ[key]
    return cell


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
            and isinstance(c.get("machine") or "", str) and (c.get("top1") is None or is_number(c["top1"]))
            for c in cells) or not isinstance(earlier.get("machine") or "", str):
        raise UserError(f"{path} is not a study's study.json (its cells are not a list of cells with run_dir, top1 "
                        f"and machine); {fix}.")
    return {c["run_dir"]: name for c in cells
            if c.get("top1") is not None and "run_dir" in c and (name := c.get("machine") or earlier.get("machine"))}


def train_records(run_dir: Path) -> list[dict]:
    from largebatch.metrics import read

    return [r for r in read(run_dir / "metrics.jsonl") if r.get("kind") == "train"]


def final_train_loss(run_dir: Path) -> float | None:
    recs = train_records(run_dir)
    return recs[-1]["loss"] if recs else None


def noise_scale(run_dir: Path) -> float | None:
    """B_simple of a run (`train.noise_scale`): sum tr(Sigma) / sum |G|^2 over the logged steps of the second half
    of training (a ratio of means, as McCandlish et al. average the two before dividing); None without them."""
    recs = [r for r in train_records(run_dir) if r.get("grad_sq") is not None and r.get("grad_trace") is not None]
    if not recs:
        return None
    half = recs[-1]["epoch"] / 2
    late = [r for r in recs if r["epoch"] >= half]
    g2 = sum(r["grad_sq"] for r in late)
    return sum(r["grad_trace"] for r in late) / g2 if g2 > 0 else None
