"""The multi-GPU contract, on the CPU: one GPU per rank, from before the first collective to the end.

Two real torchrun workers on a node of two fake GPUs (tests/fake_gpus.py: a per-thread current device that starts
at 0, object collectives marshalling on it, pinned memory and index-less "cuda" taking it, NCCL's `device_id`
binding without making current; every device the worker names is logged). The run is the one users launch on a
GPU node, `torchrun --nproc-per-node N -m largebatch train ...`, here with an ImageNet-layout JPEG tree read by
loader workers (the DataLoader's pin thread), evaluation every epoch, checkpoints, a Collapsed Ensemble's
snapshots and its SWA BN pass; then `evaluate --checkpoint` in the same way. Rank k must name cuda:k and no other
device, in every thread, and make it current before the process group exists.

Before `dist.bind_device` (commit ad5a21e) rank 1 failed here: its object collectives (`reliability.preflight`,
`rundir.agree`) and barriers ran with device 0 current.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from imagenet_tree import ilsvrc

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "fake_gpus.py"
TINY = ["--set", "model.name=resnet18", "--set", "model.stem=small", "--set", "model.width=4",
        "--set", "train.channels_last=off", "--set", "train.precision=bf16", "--set", "train.log_every=1",
        "--set", "train.plots=false", "--quiet"]


def _torchrun(args: list, log: Path, gpus: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node 2 tests/fake_gpus.py ARGS`; a launch that has not ended in 200 s
    is reported (its processes and their stacks, chaos.hung_report) and killed with all it started (torchrun
    starts each worker in a session of its own, so its own group alone would leave them running)."""
    from largebatch.commands.chaos import _descendants, hung_report

    log.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LB_FAKE_GPUS": str(gpus), "LB_FAKE_GPU_LOG": str(log), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(FAKE),
           *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        tree = [proc.pid, *_descendants(proc.pid)]
        where = hung_report(proc.pid)
        for pid in tree:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the launch did not end in 200 s:\n{where}\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _records(log: Path, rank: int) -> list[dict]:
    path = log / f"rank{rank}.jsonl"
    assert path.is_file(), f"rank {rank} logged nothing"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_rank(records: list[dict], rank: int) -> None:
    wrong = [f"{r['what']} on cuda:{r['device']} in {r['thread']} at {r['where']}" for r in records
             if r["device"] != rank]
    assert not wrong, f"rank {rank} named another GPU than cuda:{rank}:\n" + "\n".join(wrong)
    main = [r for r in records if r["thread"] == "MainThread"]
    assert main[0]["kind"] == "event" and main[0]["what"] == "set_device", \
        f"rank {rank}'s first CUDA call was {main[0]['what']} at {main[0]['where']}, not set_device"
    init = next(r for r in records if r["what"] == "init_process_group")
    assert init["device"] == rank and init["bound"] == rank, init


def test_every_rank_names_its_own_gpu_from_start_to_end(tmp_path):
    root, _ = ilsvrc(tmp_path / "imagenet", per_class=16)
    run = tmp_path / "run"
    proc = _torchrun(["train", "fashion_mnist", "--run-dir", run, "--set", "data.dataset=imagefolder",
                      "--set", f"data.root={root}", "--set", "data.image_size=32", "--set", "data.loader_workers=1",
                      "--set", "batch.global_batch=8", "--set", "schedule.epochs=2", "--set",
                      "schedule.warmup_epochs=0", "--set", "ensemble.cycles=1", "--set", "ensemble.cycle_epochs=2",
                      "--set", "ensemble.rewarm_epochs=0.5", "--set", "ensemble.collapse_epochs=0.5",
                      "--set", "ensemble.swa=true", *TINY], tmp_path / "train")
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["swa_top1"] is not None
    for rank in (1, 0):   # rank 1 first: a rank that leaves device 0 current names cuda:0
        records = _records(tmp_path / "train", rank)
        _check_rank(records, rank)
        where = " | ".join(r["where"] for r in records)
        whats = {r["what"] for r in records}
        # the parts of the run the contract covers were all reached (so a part that stopped naming its device
        # would be seen): object collectives, DDP, the pin thread, the step's streams, evaluation, the checkpoint
        # barrier, the SWA BN pass
        assert {"collective all_gather_object (current device)", "collective broadcast_object_list (current device)",
                "DistributedDataParallel(device_ids)", "pin_memory", "record_stream", "mem_get_info"} <= whats, whats
        assert any(r["what"] == "set_device" and r["thread"] != "MainThread" for r in records)   # torch's pin thread
        for part in ("save_checkpoint", "recompute_bn", "preflight", "agree"):
            assert part in where, part

    evaluated = _torchrun(["evaluate", run, "--checkpoint", sorted((run / "checkpoints").glob("step-*.pt"))[-1],
                           "--batch", "4"], tmp_path / "evaluate")
    assert evaluated.returncode == 0, evaluated.stderr[-4000:]
    for rank in (0, 1):
        _check_rank(_records(tmp_path / "evaluate", rank), rank)


def test_more_workers_than_gpus_is_one_sentence(tmp_path):
    proc = _torchrun(["train", "fashion_mnist", "--run-dir", tmp_path / "run", "--set", "data.dataset=synthetic",
                      "--set", "train.max_steps=1", *TINY], tmp_path / "log", gpus=1)
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if line.startswith("largebatch: error:")]
    assert said and all("2 workers on this node but it shows 1 GPU" in s and "--nproc-per-node 1" in s
                        for s in said), proc.stderr[-3000:]
    assert "Traceback" not in "\n".join(line for line in proc.stderr.splitlines() if line.startswith("[rank"))
    assert not (tmp_path / "run").exists()
