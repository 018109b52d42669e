"""`largebatch chaos [RECIPE] [--kills N] [--set ...]`: SIGKILL workers at random during a run and
check that it survives: it completes, every checkpoint on disk loads, and the final top-1 matches
an uninterrupted run with the same seed.

1. Baseline: the same recipe and overrides, uninterrupted, 2 workers (or reuse --baseline-dir, checked before
   any work: its summary.json readable with a top-1 (`baseline_summary`), its config.yaml that of this recipe and
   these overrides on 2 workers, logging and checkpoint keys aside (`baseline_differs`)).
2. Chaos run: `largebatch train --nproc-per-node 2 --max-restarts K` with metrics every step.
3. Kills: N times, wait until the (restarted) group is training again and has completed one new
   checkpoint (so that the run progresses however fast the kills come), then SIGKILL one worker:
   odd-numbered kills pick a random worker after a random delay; even-numbered kills wait for a
   checkpoint write to begin (a new temporary file of a step's data or metadata, with the writer's pid, in
   checkpoints/) and kill rank 0, the writer, then; the kill cut the write when that step has no metadata once
   the writer is gone.
4. Checks: exit code 0; all N kills delivered, and each ended in a resume from a checkpoint (the run's log; no
   step counter went back without one); every checkpoint with metadata verifies and loads (weights_only); steps
   lost per resume from metrics.jsonl (the last step logged before it minus the step resumed from, 0 included);
   |top-1(chaos) - top-1(baseline)| <= --tolerance points, and whether the final test losses are bitwise equal.
5. Report: a table, and chaos_report.json in the output directory. Exit 1 when a check fails.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from largebatch.cli import ArgumentParser
from largebatch.errors import UserError


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="largebatch chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", nargs="?", default="fashion_mnist", help="recipe name or YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="recipe override, passed to both runs (repeatable)")
    p.add_argument("--kills", type=int, default=10, help="SIGKILLs to deliver (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    p.add_argument("--max-delay", type=float, default=4.0, help="longest random wait before a kill, seconds")
    p.add_argument("--out", type=Path, default=Path("runs/chaos"), help="output directory")
    p.add_argument("--baseline-dir", type=Path, default=None,
                   help="reuse a finished uninterrupted run directory instead of running the baseline")
    p.add_argument("--tolerance", type=float, default=0.5, help="allowed top-1 difference in points")
    return p


def _train_cmd(recipe: str, overrides: list[str], run_dir: Path, restarts: int) -> list[str]:
    cmd = [sys.executable, "-m", "largebatch", "train", recipe, "--nproc-per-node", "2", "--run-dir", str(run_dir),
           "--max-restarts", str(restarts), "--quiet"]
    for o in [*overrides, "train.log_every=1", "train.plots=false"]:
        cmd += ["--set", o]
    return cmd


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for c in map(int, children):
                out.append(c)
                todo.append(c)
    return out


def hung_report(root: int) -> str:
    """For a run that did not end in time, before it is killed: each process under `root` (pid, parent, name,
    state, the kernel function it waits in, threads), each one's Python and native stacks where py-spy is on PATH,
    then a SIGABRT to each, workers first, which makes those with Python's faulthandler on (torch's elastic
    workers; PYTHONFAULTHANDLER) write every thread's stack to their stderr before they end."""
    import shutil
    import time

    tree = [root, *_descendants(root)]
    lines = ["the run's processes when it was stopped (pid ppid name state wchan threads):"]
    for pid in tree:
        try:
            head, tail = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
            lines.append(f"  {pid} {tail.split()[1]} {head.split('(', 1)[1]} {tail.split()[0]} "
                         f"{Path(f'/proc/{pid}/wchan').read_text().strip()} {len(os.listdir(f'/proc/{pid}/task'))}")
        except OSError:
            pass
    spy = shutil.which("py-spy")
    for pid in tree if spy else []:
        dump = subprocess.run([str(spy), "dump", "--native", "--pid", str(pid)], capture_output=True, text=True)
        lines.append(f"py-spy dump --native --pid {pid}:\n{dump.stdout}{dump.stderr}")
    for pid in reversed(tree):
        try:
            os.kill(pid, signal.SIGABRT)
        except OSError:
            pass
    time.sleep(2)
    return "\n".join(lines)


def _workers(launcher: int) -> dict[int, tuple[int, int]]:
    """pid -> (rank, restart attempt) of the training workers under the launcher."""
    found = {}
    for pid in _descendants(launcher):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if "TORCHELASTIC_RESTART_COUNT" in env and "RANK" in env:   # a worker torchrun started
            found[pid] = (int(env["RANK"]), int(env["TORCHELASTIC_RESTART_COUNT"]))
            continue
        named = _WORKER_NAME.match(_comm(pid))   # a worker forked by the launch's forkserver (launch.WORKER_NAME)
        if named:
            found[pid] = (int(named["rank"]), int(named["attempt"]))
    return found


_WORKER_NAME = re.compile(r"^lb-w(?P<rank>\d+)-r(?P<attempt>\d+)$")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _train_lines(metrics: Path) -> int:
    try:
        return sum(1 for line in metrics.read_text().splitlines() if '"kind": "train"' in line)
    except OSError:
        return 0


def _wait_training(proc: subprocess.Popen, metrics: Path, attempt: int, timeout: float = 600.0) -> dict | None:
    """Step 3: wait until every worker of `attempt` runs and a new train line was logged after it started."""
    deadline = time.time() + timeout
    seen_lines = None
    while time.time() < deadline and proc.poll() is None:
        workers = _workers(proc.pid)
        mine = {pid: r for pid, (r, a) in workers.items() if a == attempt}
        if len(mine) == 2:
            if seen_lines is None:
                seen_lines = _train_lines(metrics)
            elif _train_lines(metrics) > seen_lines:
                return mine
        time.sleep(0.05)
    return None


def _wait_new_checkpoint(proc: subprocess.Popen, ckpt_dir: Path, timeout: float = 600.0) -> bool:
    """Step 3: wait until a checkpoint newer than the ones on disk now is complete (progress is kept)."""
    before = {p.name for p in ckpt_dir.glob("step-*.json")}
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if {p.name for p in ckpt_dir.glob("step-*.json")} - before:
            return True
        time.sleep(0.05)
    return False


def _writes(ckpt_dir: Path, writer: int) -> dict[str, int]:
    """The temporary files of checkpoint writes by `writer` in `ckpt_dir` (`checkpoint.OWN_TMP` of a step's data or
    metadata; the manifest's is no checkpoint write: it is rewritten after one completes): name -> step."""
    from largebatch.checkpoint import OWN_TMP

    try:
        names = [e.name for e in os.scandir(ckpt_dir)]
    except OSError:
        return {}
    return {n: int(m[1]) for n in names if (m := OWN_TMP.fullmatch(n)) and m[1] and int(m[2]) == writer}


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    """Until `pid` has exited (gone, or a zombie its parent has not reaped yet): SIGKILL is delivered after
    os.kill returns, and a writer that still runs may finish the write it was killed in."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.001)


def _kill_in_checkpoint_write(proc: subprocess.Popen, ckpt_dir: Path, writer: int,
                              timeout: float) -> tuple[bool, bool]:
    """Step 3 (even kills): SIGKILL the writer as soon as it begins writing a checkpoint (a new temporary file of
    a step's data or metadata with its pid); (a write was seen, the kill cut it: that step has no metadata once the
    writer is gone, so a resume cannot take it). Temporary files there before the wait are not a write: an
    earlier kill left them, and the writer removes them only after a minute. No write within `timeout`: the
    writer is killed then, (False, False)."""
    stale = set(_writes(ckpt_dir, writer))
    deadline = time.time() + timeout
    step = None
    while step is None and time.time() < deadline and proc.poll() is None:
        step = next((s for n, s in _writes(ckpt_dir, writer).items() if n not in stale), None)
        if step is None:
            time.sleep(0.0005)
    try:
        os.kill(writer, signal.SIGKILL)
    except ProcessLookupError:   # the run ended first
        return False, False
    if step is None:
        return False, False
    _wait_gone(writer)
    from largebatch.checkpoint import PREFIX

    return True, not (ckpt_dir / f"{PREFIX}{step:08d}.json").exists()


RESUMED = re.compile(r"largebatch: resumed from .* at step (\d+)\.")


def steps_lost(metrics: Path, resumed: list[int]) -> tuple[list[int], list[int]]:
    """Step 4: (for every resume, the last step logged before it minus the step resumed from; the steps lost by
    restarts with no resume in the log). `resumed`: the steps resumed from, in order, from the run's log. A resume
    from the step logged last lost none; nothing in metrics.jsonl marks it, so it is a 0 here, not a gap. A step
    counter that went back to a step no resume names is a restart from scratch (or from a checkpoint not said)."""
    from largebatch.metrics import read

    steps = [r["step"] for r in read(metrics) if r.get("kind") == "train"]   # a torn last line skipped
    back = [(cur - 1, prev - (cur - 1)) for prev, cur in zip(steps, steps[1:]) if cur <= prev]
    lost, unexplained, j = [], [], 0
    for start in resumed:
        k = next((k for k in range(j, len(back)) if back[k][0] == start), None)
        if k is None:
            lost.append(0)
            continue
        unexplained += [n for _, n in back[j:k]]
        lost.append(back[k][1])
        j = k + 1
    return lost, unexplained + [n for _, n in back[j:]]


def check_checkpoints(ckpt_dir: Path) -> tuple[int, list[str]]:
    from largebatch import checkpoint

    bad = []
    metas = sorted(ckpt_dir.glob("step-*.json"))
    for meta in metas:
        if checkpoint.verify(meta) is None:
            bad.append(meta.name)
            continue
        try:
            checkpoint.load(meta.with_suffix(".pt"))
        except Exception as exc:   # report every failure, not just the first
            bad.append(f"{meta.name}: {exc}")
    return len(metas), bad


# Keys a baseline may set otherwise: they change what is logged or kept, never the trained weights.
NOT_COMPARED = {"recipe", "train.log_every", "train.plots", "train.tensorboard", "train.checkpoint_every",
                "train.keep_checkpoints", "train.threads", "data.loader_workers", "comm.timeout_s"}


def baseline_summary(base_dir: Path) -> dict:
    """Step 1: the baseline's summary.json, one sentence naming it when it is damaged or edited."""
    path = base_dir / "summary.json"
    fix = "give the run directory of a finished uninterrupted run, or drop --baseline-dir to run one"
    try:
        summ = json.loads(path.read_bytes())
    except (OSError, ValueError):
        raise UserError(f"--baseline-dir: {path} is not readable JSON (cut short or edited?); {fix}.") from None
    top1 = summ.get("final_top1") if isinstance(summ, dict) else None
    if not isinstance(top1, (int, float)) or isinstance(top1, bool) or not 0 <= top1 <= 1:
        raise UserError(f"--baseline-dir: {path} has final_top1 {top1!r}, not a top-1 between 0 and 1; {fix}.")
    return summ


def baseline_differs(cfg, base_dir: Path) -> list[str]:
    """Step 1: the keys (`section.key ours vs theirs`) in which the baseline's config.yaml differs from `cfg`,
    and its world size when it is not 2; `NOT_COMPARED` aside."""
    import dataclasses

    from largebatch.commands.evaluate import load_run_config

    theirs = dataclasses.asdict(load_run_config(base_dir))
    ours = dataclasses.asdict(cfg)
    out = []
    for section, values in ours.items():
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            other = (theirs.get(section) or {}).get(key)
            if f"{section}.{key}" not in NOT_COMPARED and other != value:
                out.append(f"{section}.{key} {value!r} vs {other!r}")
    summary = base_dir / "summary.json"
    if summary.exists():
        world = baseline_summary(base_dir).get("world_size")
        if world not in (None, 2):
            out.append(f"2 workers vs {world}")
    return out


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.kills < 1:
        raise UserError(f"--kills is {args.kills}; give 1 or more.")
    for flag, value in (("--max-delay", args.max_delay), ("--tolerance", args.tolerance)):
        if not 0 <= value < math.inf:   # also nan; checked before the baseline run, not after it
            raise UserError(f"{flag} is {value}; give a finite number >= 0.")
    from largebatch import config as config_mod

    cfg = config_mod.load(args.recipe, args.overrides)   # fail fast on a bad recipe or override
    if not cfg.train.checkpoint_every:
        print("largebatch chaos: train.checkpoint_every is 0; checkpoints only at epoch ends (add "
              "--set train.checkpoint_every=N to lose fewer steps per kill).", file=sys.stderr)
    from largebatch import rundir

    # Inputs are checked before any work: a missing baseline must not cost a whole chaos run first.
    if args.baseline_dir is not None:
        if not args.baseline_dir.is_dir():
            raise UserError(f"--baseline-dir {args.baseline_dir} is not a directory; give the run directory of an "
                            "uninterrupted run of the same recipe, or drop --baseline-dir to run one.")
        if not (args.baseline_dir / "summary.json").exists() and not rundir.in_use(args.baseline_dir):
            raise UserError(f"--baseline-dir {args.baseline_dir} has no summary.json and no run is writing it; "
                            "finish it with largebatch train --resume, or drop --baseline-dir to run one.")
        if (args.baseline_dir / "summary.json").exists():
            baseline_summary(args.baseline_dir)
        differ = baseline_differs(config_mod.load(args.recipe, [*args.overrides, "train.log_every=1",
                                                                 "train.plots=false"]), args.baseline_dir)
        if differ:
            shown = "; ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
            raise UserError(f"--baseline-dir {args.baseline_dir} is a run of other settings than this chaos run "
                            f"(this run vs the baseline: {shown}); give a baseline of the same recipe and --set "
                            "options, or drop --baseline-dir to run one.")
    for sub in ("chaos", "baseline"):
        if rundir.holds_run(args.out / sub) and not (sub == "baseline" and args.baseline_dir is not None):
            raise UserError(f"--out {args.out} already holds a chaos run ({args.out / sub}); give a fresh --out.")
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    # 1. baseline
    base_dir = args.baseline_dir or args.out / "baseline"
    if args.baseline_dir is None:
        print(f"largebatch chaos: baseline run in {base_dir}", file=sys.stderr, flush=True)
        with open(args.out / "baseline.log", "w") as log:
            rc = subprocess.call(_train_cmd(args.recipe, args.overrides, base_dir, 0), stdout=log, stderr=log)
        if rc != 0:
            print(f"largebatch chaos: the baseline run failed ({rc}); see {args.out / 'baseline.log'}", file=sys.stderr)
            return 1

    # 2. chaos run
    run_dir = args.out / "chaos"
    metrics, ckpt_dir = run_dir / "metrics.jsonl", run_dir / "checkpoints"
    log = open(args.out / "chaos.log", "w")
    t0 = time.time()
    proc = subprocess.Popen(_train_cmd(args.recipe, args.overrides, run_dir, args.kills + 5), stdout=log,
                            stderr=log, start_new_session=True)
    kills: list[dict[str, Any]] = []
    try:
        # 3. kills
        for k in range(args.kills):
            workers = _wait_training(proc, metrics, attempt=k)
            if workers is None or not _wait_new_checkpoint(proc, ckpt_dir):
                break
            if k % 2 == 1:
                writer = next(pid for pid, r in workers.items() if r == 0)
                seen, in_write = _kill_in_checkpoint_write(proc, ckpt_dir, writer, timeout=120)
                kills.append({"kill": k + 1, "rank": 0, "kind": "checkpoint write" if seen else "no write in 120 s",
                              "in_write": in_write, "time_s": round(time.time() - t0, 1)})
            else:
                time.sleep(rng.uniform(0, args.max_delay))
                pid, rank = rng.choice(sorted(workers.items()))
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                kills.append({"kill": k + 1, "rank": rank, "kind": "random moment", "in_write": False,
                              "time_s": round(time.time() - t0, 1)})
            print(f"largebatch chaos: kill {k + 1}: {kills[-1]}", file=sys.stderr, flush=True)
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    wall = time.time() - t0

    # 4. checks
    while args.baseline_dir is not None and not (base_dir / "summary.json").exists() and rundir.in_use(base_dir):
        time.sleep(5)   # a baseline started alongside this command is still running (it holds its lock)
    if not (base_dir / "summary.json").exists():
        raise UserError(f"the baseline run {base_dir} has no summary.json; let it finish or drop --baseline-dir.")
    base = baseline_summary(base_dir)
    checked, bad = check_checkpoints(ckpt_dir)
    summary_path = run_dir / "summary.json"
    chaos = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    run_log = (args.out / "chaos.log").read_text(errors="replace")
    resumed = [int(m) for m in RESUMED.findall(run_log)]
    lost, unexplained = steps_lost(metrics, resumed) if metrics.exists() else ([], [])
    diff = 100 * (chaos.get("final_top1", float("nan")) - base["final_top1"])
    report = {
        "kills": len(kills), "kills_in_checkpoint_write": sum(k["in_write"] for k in kills),
        "resumes_from_checkpoint": len(resumed), "steps_lost_per_resume": lost,
        "steps_lost_without_resume": unexplained,
        "steps_lost_mean": sum(lost) / max(len(lost), 1), "steps_lost_max": max(lost, default=0),
        "exit_code": rc, "checkpoints_checked": checked, "checkpoints_bad": bad,
        "corrupt_checkpoint_reports": run_log.count("is corrupt or truncated"),
        "final_top1": chaos.get("final_top1"), "baseline_top1": base["final_top1"], "top1_diff_points": diff,
        "final_loss_bitwise_equal": chaos.get("final_loss") is not None and chaos.get("final_loss") == base.get(
            "final_loss"),
        "steps": chaos.get("steps"), "baseline_steps": base.get("steps"), "wall_s": round(wall, 1),
        "baseline_wall_s": base.get("wall_s"), "kill_log": kills,
        "command": "largebatch chaos " + " ".join(argv),
    }
    ok = (rc == 0 and not bad and abs(diff) <= args.tolerance and len(kills) == args.kills
          and len(resumed) == len(kills) and not unexplained)   # every kill ended in a resume from a checkpoint
    report["passed"] = ok
    from largebatch.checkpoint import atomic_write

    atomic_write(args.out / "chaos_report.json", json.dumps(report, indent=2).encode())   # whole or absent

    # 5. report
    from rich.console import Console
    from rich.table import Table

    table = Table(title="largebatch chaos", show_header=False)
    for key, value in report.items():
        if key != "kill_log":
            table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console(stderr=True).print(table)
    print(f"largebatch chaos: {'PASSED' if ok else 'FAILED'}; report in {args.out / 'chaos_report.json'}",
          file=sys.stderr)
    return 0 if ok else 1
