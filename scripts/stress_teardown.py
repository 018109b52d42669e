"""Stress the start-up and teardown of 2-worker runs under CPU load; count the exits that are not clean.

    python scripts/stress_teardown.py --runs 100 --json results/reliability/stress.json

Each run is a real `largebatch train --nproc-per-node 2` (torch's elastic launcher, gloo, the watchdog's
publisher thread on, as in every launched run) of the default recipe for a few steps, while `--hog`
busy processes keep the cores saturated. The cases, taken in turn:

- finish:      the default recipe, 3 steps                          -> exit code 0
- tiny-checkpoints: a tiny synthetic run of 8 short steps with a checkpoint every 2 (the shape of the
               runs in which the abort at exit was first seen)             -> 0
- p2p-hook:    the same with comm.algorithm=ring (the comm thread)  -> 0
- early-error: rank 1 raises a user error at step 1 (LARGEBATCH_FAULTS=error@1:1) -> 2
- sigterm:     SIGTERM to the launcher after the first logged step  -> 143
- eval-2, eval-3: test_train.py's evaluation run as it is (not BASE): a ResNet-18 of width 4 on
               Fashion-MNIST, 2 steps and the evaluation of all 10,000 test images (an all-gather), on 2 and
               3 workers, OMP_NUM_THREADS=1 as in the suite (the runs in which the end-of-launch deadlock was
               met, docs/reliability.md's Teardown)                                -> 0

A run is unclean when its exit code differs from the expected one, or its output shows an abort
("terminate called", "Fatal Python error") or, for the user error, a traceback. A run still going at
--timeout is hung: before it is killed, its processes (pid, parent, name, state, kernel wait, threads) and,
where py-spy is on PATH, each one's Python and native stacks go into its log, then a SIGABRT to each writes
the stacks of those with faulthandler on (PYTHONFAULTHANDLER=1 here). The logs of unclean runs are kept under
--out; the counts go to stdout and --json. --parallel runs that many at a time (the suite runs two).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from largebatch.commands.chaos import hung_report

ROOT = Path(__file__).resolve().parent.parent
BASE = ["--set", "train.max_steps=3", "--set", "train.log_every=1", "--set", "train.plots=false",
        "--set", "train.eval_every=0", "--quiet"]
TINY = ["--set", "model.width=8", "--set", "data.dataset=synthetic", "--set", "data.synthetic_size=512",
        "--set", "data.image_size=16", "--set", "batch.global_batch=64", "--set", "train.max_steps=8",
        "--set", "train.checkpoint_every=2"]
EVAL = ["--set", "batch.global_batch=48", "--set", "train.max_steps=2", "--set", "model.name=resnet18",
        "--set", "model.stem=small", "--set", "model.width=4", "--set", "train.channels_last=off",
        "--set", "train.eval_flip=false", "--set", "train.precision=fp32", "--set", "train.log_every=1",
        "--set", "train.plots=false", "--quiet"]   # test_train.py's 3-worker evaluation test, whole (not BASE)
CASES = {   # case: (options, environment, expected exit code, workers)
    "finish": ([], {}, 0, 2),
    "tiny-checkpoints": (TINY, {}, 0, 2),
    "p2p-hook": (["--set", "comm.algorithm=ring"], {}, 0, 2),
    "early-error": ([], {"LARGEBATCH_FAULTS": "error@1:1"}, 2, 2),
    "sigterm": ([], {}, 143, 2),
    "eval-2": (EVAL, {"OMP_NUM_THREADS": "1"}, 0, 2),   # one BLAS thread, as the suite's runs: the launcher forks
    "eval-3": (EVAL, {"OMP_NUM_THREADS": "1"}, 0, 3),   # its forkserver (launch._fork_is_safe)
}
DEFAULT_CASES = ("finish", "tiny-checkpoints", "p2p-hook", "early-error", "sigterm")
ABORTS = ("terminate called", "Fatal Python error", "core dumped")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run_one(case: str, run_dir: Path, timeout_s: float) -> tuple[int, str]:
    extra, env, _, workers = CASES[case]
    cmd = [sys.executable, "-m", "largebatch", "train", "--nproc-per-node", str(workers), "--run-dir", str(run_dir),
           *([] if extra is EVAL else BASE), *extra]
    log = run_dir.with_suffix(".log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **env})
        deadline = time.monotonic() + timeout_s
        if case == "sigterm":   # after the first logged step: the workers are training
            metrics = run_dir / "metrics.jsonl"
            while proc.poll() is None and time.monotonic() < deadline:
                if metrics.exists() and metrics.stat().st_size > 0:
                    proc.send_signal(signal.SIGTERM)
                    break
                time.sleep(0.05)
        try:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            report = hung_report(proc.pid)   # its processes and stacks
            proc.kill()
            code = proc.wait()
            out.write(f"\nstress: hung, killed after {timeout_s:.0f} s\n{report}\n")
    return code, log.read_text()


def unclean(case: str, code: int, text: str) -> str | None:
    expected = CASES[case][2]
    if "stress: hung" in text:
        return "hung"
    if any(a in text for a in ABORTS):
        return "abort in output"
    if code != expected:
        return f"exit code {code}, expected {expected}"
    if case == "early-error" and "Traceback" in text:
        return "traceback after a user error"
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--hog", type=int, default=2, help="busy processes beside the runs")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time")
    p.add_argument("--out", type=Path, default=None, help="keep the logs of unclean runs here")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it counts as hung")
    args = p.parse_args()
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown or args.runs < 1 or args.hog < 0 or args.parallel < 1:
        p.error(f"--cases from {', '.join(CASES)}; --runs >= 1; --hog >= 0; --parallel >= 1 (got {sorted(unknown)})")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    tmp = Path(tempfile.mkdtemp(prefix="largebatch-stress-"))
    counts = {c: {"runs": 0, "unclean": 0} for c in cases}
    failures = []
    t0 = time.time()
    lock = threading.Lock()

    def one(i: int) -> None:
        case = cases[i % len(cases)]
        run_dir = tmp / f"run{i:03d}-{case}"
        code, text = run_one(case, run_dir, args.timeout)
        why = unclean(case, code, text)
        with lock:
            counts[case]["runs"] += 1
            if why:
                counts[case]["unclean"] += 1
                failures.append({"run": i, "case": case, "exit_code": code, "why": why})
                if args.out:
                    args.out.mkdir(parents=True, exist_ok=True)
                    shutil.copy(run_dir.with_suffix(".log"), args.out / f"run{i:03d}-{case}.log")
            print(f"run {i + 1}/{args.runs} {case}: exit {code}{'  UNCLEAN: ' + why if why else ''}", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.with_suffix(".log").unlink(missing_ok=True)

    try:
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(one, range(args.runs)))
    finally:
        for h in hogs:
            h.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    total = sum(c["unclean"] for c in counts.values())
    result = {"command": "python scripts/stress_teardown.py " + " ".join(sys.argv[1:]),
              "machine": f"{cpu_model()}, {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"),
              "hog_processes": args.hog, "parallel": args.parallel, "runs": args.runs, "unclean": total, "per_case": counts,
              "failures": failures, "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
