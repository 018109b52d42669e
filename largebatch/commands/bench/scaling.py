"""`largebatch bench scaling`: weak-scaling efficiency of real training from 1 to N workers, per all-reduce algorithm.

Weak scaling: efficiency(N) = throughput(N) / (N x throughput(1)) at the same per-worker batch.

1. One worker: `largebatch train` (the real trainer, one process, --threads intra-op threads) on the synthetic
   source for 2 x --steps steps of --per-worker-batch images, logging every --steps steps; its images/s is
   that of the second logged stretch (the first covers start-up and the allocator's warm-up).
2. N workers: the same through `largebatch train --nproc-per-node N` (torchrun, gloo on 127.0.0.1), global
   batch N x per-worker batch, --threads threads each, once per algorithm (--algorithms: the comm.algorithm
   values, `noop` = DDP with a hook that communicates nothing: the compute-only ceiling).
3. --repeats rounds, each running 1. and every 2. in turn, so a load change on a shared machine hits all
   entries alike; each entry's figure is its median round. Efficiency per algorithm = images/s(N) /
   (N x images/s(1)); the best communicating algorithm is reported beside the noop ceiling.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from largebatch.commands.bench import machine
from largebatch.checkpoint import atomic_write
from largebatch.cli import ArgumentParser
from largebatch.comm.options import ALLREDUCE, HOOK_ONLY
from largebatch.errors import UserError
from largebatch.metrics import read

ALGORITHMS = ALLREDUCE + HOOK_ONLY


def run_training(args, world: int, algorithm: str, run_dir: Path) -> float:
    """Steps 1-2: one real training run; returns the images/s of its second logged stretch."""
    sets = {
        "model.name": args.model, "model.width": args.width,
        "data.dataset": "synthetic", "data.image_size": args.image_size, "data.num_classes": 10,
        "data.synthetic_size": args.per_worker_batch * world * (2 * args.steps + 1),
        "batch.global_batch": args.per_worker_batch * world,
        "schedule.epochs": 1, "schedule.warmup_epochs": 0,
        "train.max_steps": 2 * args.steps, "train.log_every": args.steps, "train.eval_every": 0,
        "train.threads": args.threads, "train.plots": False, "train.precision": args.precision,
        "train.channels_last": "\"on\"" if args.channels_last else "\"off\"",   # quoted: YAML reads on/off as booleans
        "comm.algorithm": algorithm,
    }
    cmd = [sys.executable, "-m", "largebatch", "train", "--run-dir", str(run_dir), "--quiet"]
    if world > 1:
        cmd += ["--nproc-per-node", str(world)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        tail = (proc.stdout[-1500:] + proc.stderr[-3000:]).strip()
        if proc.returncode == 2:
            raise UserError(f"the {world}-worker run with comm.algorithm={algorithm} was refused: "
                            f"{tail.splitlines()[-1] if tail else 'no message'}")
        raise RuntimeError(f"training run failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")
    records = read(run_dir / "metrics.jsonl")   # a torn last line skipped, a foreign one one sentence
    train = [r for r in records if r["kind"] == "train"]
    if len(train) < 2:
        raise RuntimeError(f"expected two logged stretches in {run_dir / 'metrics.jsonl'}, got {len(train)}")
    return float(train[-1]["images_per_s"])


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="largebatch bench scaling", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="N: workers of the scaled runs (one machine)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated comm.algorithm values")
    from largebatch.models import MODELS

    p.add_argument("--model", default="resnet18", help=f"architecture: one of {', '.join(MODELS)}")
    p.add_argument("--width", type=int, default=32, help="channels of the first stage")
    p.add_argument("--image-size", type=int, default=32, help="synthetic image size (<= 64: small stem)")
    p.add_argument("--per-worker-batch", type=int, default=64, help="images per worker per step")
    p.add_argument("--steps", type=int, default=6, help="steps per logged stretch (2 stretches per run)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per worker")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="train.precision")
    p.add_argument("--channels-last", action="store_true", help="train.channels_last=on")
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds (median reported)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per training run")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    algorithms = [a for a in args.algorithms.split(",") if a]
    bad = [a for a in algorithms if a not in ALGORITHMS]
    if bad or not algorithms:
        raise UserError(f"--algorithms has {', '.join(bad) or 'nothing'}; choose from {', '.join(ALGORITHMS)}.")
    from largebatch.cli import check_numbers, check_output_path
    from largebatch.config import check_threads
    from largebatch.launch import check_worker_count

    check_numbers(("--workers", args.workers, args.workers >= 2, "2 or more"),
                  *((f"--{name.replace('_', '-')}", getattr(args, name), getattr(args, name) >= 1, "1 or more")
                    for name in ("per_worker_batch", "steps", "threads", "repeats", "width")),
                  ("--image-size", args.image_size, args.image_size >= 1, "1 or more pixels"),
                  ("--timeout", args.timeout, 0 < args.timeout < math.inf, "a positive number of seconds"))
    # before the one-worker runs: found by the scaled run's launcher, these were named as its flags (--nproc-per-node,
    # train.threads) after the whole baseline
    check_worker_count("--workers", args.workers, low=2)
    check_threads("--threads", args.threads)
    from largebatch.models import check_model_name
    from largebatch.models.classifier import check_input_size

    check_model_name(args.model, "--model")
    # before any worker starts: the model takes --image-size (the runs' model.stem is auto: small up to 64 px)
    check_input_size(args.model, args.image_size, "--image-size", stem="small" if args.image_size <= 64 else "imagenet")
    check_output_path("--json", args.json)

    single: list[float] = []
    scaled: dict[str, list[float]] = {a: [] for a in algorithms}
    with tempfile.TemporaryDirectory(prefix="largebatch-bench-scaling-") as tmp:
        for r in range(args.repeats):   # step 3: interleaved rounds
            single.append(run_training(args, 1, "native", Path(tmp) / f"r{r}-w1"))
            print(f"round {r + 1}: 1 worker {single[-1]:.1f} img/s", flush=True)
            for a in algorithms:
                scaled[a].append(run_training(args, args.workers, a, Path(tmp) / f"r{r}-w{args.workers}-{a}"))
                print(f"round {r + 1}: {args.workers} workers {a} {scaled[a][-1]:.1f} img/s "
                      f"({scaled[a][-1] / (args.workers * single[-1]):.1%})", flush=True)
    one = statistics.median(single)
    results = {a: {"images_per_s": statistics.median(v), "rounds": v,
                   "efficiency": statistics.median(v) / (args.workers * one)} for a, v in scaled.items()}
    communicating = [a for a in algorithms if a != "noop"]
    best = max(communicating, key=lambda a: results[a]["efficiency"]) if communicating else None
    out = {
        "machine": machine(torch.device("cpu")),
        "model": args.model, "width": args.width, "image_size": args.image_size,
        "per_worker_batch": args.per_worker_batch, "workers": args.workers, "threads_per_worker": args.threads,
        "precision": args.precision, "single_images_per_s": one, "single_rounds": single,
        "efficiency": {a: r["efficiency"] for a, r in results.items()},
        "best_algorithm": best, "best_efficiency": results[best]["efficiency"] if best else None,
        "ceiling_efficiency": results["noop"]["efficiency"] if "noop" in results else None,
        "algorithms": results,
    }
    print(f"weak scaling 1 -> {args.workers} workers ({args.model} w{args.width} @ {args.image_size} px, "
          f"{args.per_worker_batch} img/worker, {args.threads} thread(s) each); 1 worker {one:.1f} img/s")
    for a, res in results.items():
        print(f"  {a:<17} {res['images_per_s']:8.1f} img/s  efficiency {res['efficiency']:.1%}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(args.json, (json.dumps(out, indent=2)).encode())   # whole or absent
    return 0
