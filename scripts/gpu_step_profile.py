"""Where largebatch's CUDA training step loses to a plain loop (docs/gpu.md), on one GPU.

    python scripts/gpu_step_profile.py --out DIR [--config bf16-cl] [--batch 256] [--steps 10]

For one configuration (PRECISION[-cl], as `largebatch bench train --configs`), ResNet-50 at 224 px:
1. images/s, interleaved rounds, of: torchvision's resnet50 through bench train's plain loop; largebatch's
   resnet50 through the same plain loop; largebatch's Trainer step as `bench train` times it (staged,
   pinned micro-batches); the same step on pageable copies of them (clone() per step, as an in-process
   source delivers); and fetching the next micro-batch from the synthetic source alone.
2. torch.profiler of 5 Trainer steps and of 5 plain-loop steps of largebatch's model: operators by
   self CUDA time and by self CPU time, written to DIR/profile_step.txt and DIR/profile_plain.txt.
Figures go to DIR/step_profile.json.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from largebatch.commands.bench.baselines import peer_model, plain_step_fn
from largebatch.commands.bench.train import largebatch_step_fn, measure, parse_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--config", default="bf16-cl")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script with tiny sizes")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda:0" if a.device == "cuda" else a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.benchmark = True
    spec = parse_config(a.config)
    args = argparse.Namespace(model="resnet50", width=64, image_size=a.image_size, classes=1000, batch=a.batch,
                              optimizer="sgd", threads=None)
    with tempfile.TemporaryDirectory() as tmp:
        peer = peer_model("torchvision", "resnet50", 1000)
        entries = {} if isinstance(peer, str) else {"torchvision_plain": plain_step_fn(args, 1000, device, peer, spec)}
        entries["largebatch_plain"] = plain_step_fn(args, 1000, device, None, spec)
        step = largebatch_step_fn(args, spec, Path(tmp) / "t", device)
        entries["trainer_step"] = step   # on staged, pinned micro-batches
        parts = step.parts
        fixed = parts.staged[0]
        entries["trainer_fetch_only"] = lambda: [parts.next_micro() for _ in range(parts.phase.accumulation)]
        entries["trainer_step_pageable_input"] = lambda: parts.trainer.train_step(
            0, [(x.clone(), y.clone()) for x, y in parts.staged[:parts.phase.accumulation]], parts.phase, parts.lr)
        results = measure(entries, a.batch, a.steps, a.rounds, print, device)
        out = {"config": a.config, "batch": a.batch, "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "images_per_s": {n: round(r["images_per_s"], 1) if "images_per_s" in r else r["error"]
                                for n, r in results.items()},
               "micro_batch": [list(t.shape) for t in fixed], "micro_dtype": [str(t.dtype) for t in fixed],
               "micro_pinned": [t.is_pinned() for t in fixed], "accumulation": parts.phase.accumulation}
        print(json.dumps(out, indent=1), flush=True)
        (a.out / "step_profile.json").write_text(json.dumps(out, indent=1) + "\n")
        from torch.profiler import ProfilerActivity, profile

        for name in ("trainer_step", "largebatch_plain"):
            if name not in entries:   # it failed in measure(): its error is in step_profile.json
                continue
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    entries[name]()
                if device.type == "cuda":
                    torch.cuda.synchronize()
            ka = prof.key_averages()
            text = (ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60) + "\n\n"
                    + ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
            (a.out / f"profile_{name.split('_')[-1]}.txt").write_text(text)


if __name__ == "__main__":
    main()
