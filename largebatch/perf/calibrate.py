"""`largebatch plan --calibrate`: measure this machine and store a "this-machine" catalog entry.

Runs `nproc` real worker processes on 127.0.0.1 (gloo), each with cores // nproc threads, so the
measurement sees the same sharing of cores as an `nproc`-process training run:

1. Peak: a timed fp32 matmul (n x n x n, 2n^3 FLOPs) in every worker at once; the median rate.
2. Compute curve: forward + backward + SGD step of the model at two per-device batches b1 < b2
   in every worker at once (no communication); the medians t1, t2 fit t(b) = t_img (b + b_half):
   t_img = (t2 - t1) / (b2 - b1), b_half = t1 / t_img - b1, eff_max = 3F / (peak t_img).
3. Memory bandwidth: a timed copy of a 64 MB tensor (read + write).
4. Link: all-reduce times T(S) of gloo on loopback for a few message sizes S; for p ranks on one
   ring T = 2(p-1) alpha + 2(p-1)/p S beta: the slope b between the two largest sizes gives
   bandwidth = 2(p-1) / (p b), the smallest size gives alpha = (T - b S) / (2(p-1)).
5. Write `devices.this-machine` and `links.loopback` to the user catalog file (never the package).
"""
from __future__ import annotations

import datetime
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from largebatch.launch import free_port
from largebatch.perf.catalog import clear_cache, read_user_catalog, user_catalog_path
from largebatch.perf.flops import model_cost


def _timed(fn, reps: int) -> float:
    """Median seconds of `reps` calls after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _worker(rank: int, world: int, port: int, spec: dict[str, Any], results: Any) -> None:
    from largebatch.models import build_model

    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        out: dict[str, Any] = {}
        n = spec["matmul_n"]  # 1.
        a, b = torch.randn(n, n), torch.randn(n, n)
        dist.barrier()
        out["matmul_s"] = _timed(lambda: torch.mm(a, b), spec["reps"])
        torch.manual_seed(0)  # 2.
        model = build_model(spec["model"], spec["num_classes"], in_channels=spec["in_channels"],
                            stem=spec["stem"], width=spec["width"])
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["precision"])
        for key, bsz in (("t1", spec["b1"]), ("t2", spec["b2"])):
            x = torch.randn(bsz, spec["in_channels"], spec["image_size"], spec["image_size"])
            y = torch.randint(0, spec["num_classes"], (bsz,))

            def step() -> None:
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()

            dist.barrier()
            out[key] = _timed(step, spec["reps"])
        src = torch.empty(16 * 2**20, dtype=torch.uint8)  # 3.
        dst = torch.empty_like(src)
        out["copy_s"] = _timed(lambda: dst.copy_(src), spec["reps"])
        out["allreduce"] = {}
        for size in spec["sizes"]:  # 4.
            t = torch.zeros(size // 4)
            dist.barrier()
            out["allreduce"][size] = _timed(lambda: dist.all_reduce(t), spec["reps"])
        results[rank] = out
    finally:
        dist.destroy_process_group()


def measure(model: str = "resnet18", image_size: int = 28, in_channels: int = 1, num_classes: int = 10,
            stem: str = "small", width: int = 16, precision: str = "fp32", nproc: int = 2,
            b1: int = 32, b2: int = 128, reps: int = 5, matmul_n: int = 1024,
            sizes: tuple[int, ...] = (2**12, 2**20, 2**22, 2**24)) -> dict[str, Any]:
    """Steps 1-4 in `nproc` real processes; returns the catalog entries (not yet written)."""
    threads = max(1, (os.cpu_count() or 1) // nproc)
    spec = dict(model=model, image_size=image_size, in_channels=in_channels, num_classes=num_classes, stem=stem,
                width=width, precision=precision, b1=b1, b2=b2, reps=reps, matmul_n=matmul_n, sizes=list(sizes),
                threads=threads)
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(nproc, free_port(), spec, results), nprocs=nproc, join=True)
    res = [results[r] for r in range(nproc)]
    manager.shutdown()

    med = lambda key: statistics.median(r[key] for r in res)  # noqa: E731
    peak = 2.0 * matmul_n**3 / med("matmul_s")
    t1, t2 = med("t1"), med("t2")
    t_img = max((t2 - t1) / (b2 - b1), 1e-12)
    b_half = max(0.0, t1 / t_img - b1)
    flops = model_cost(model, image_size, in_channels, num_classes, stem, width).forward_flops
    eff_max = 3.0 * flops / (peak * t_img)
    mem_gbs = 2.0 * 16 * 2**20 / med("copy_s") / 1e9
    xs = list(sizes)
    ys = [statistics.median(r["allreduce"][s] for r in res) for s in xs]
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 1e-15)   # bandwidth from the two largest sizes
    p = nproc
    alpha = max(0.0, ys[0] - slope * xs[0]) / (2 * (p - 1)) if p > 1 else 0.0  # latency from the smallest
    bw = 2 * (p - 1) / (p * max(slope, 1e-15)) if p > 1 else 1e12
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    what = f"{model} ({stem} stem, width {width}, {in_channels}x{image_size}x{image_size}, {precision})"
    return {
        "devices": {"this-machine": {
            "name": f"this machine: one of {nproc} processes with {threads} thread(s)",
            "peak_tflops": {precision: peak / 1e12, "fp32": peak / 1e12} if precision != "fp32" else {"fp32": peak / 1e12},
            "peak_source": f"measured {when}: fp32 matmul {matmul_n}^3 in {nproc} processes at once",
            "memory_gbs": mem_gbs,
            "memory_source": f"measured {when}: 16 MB tensor copy",
            "efficiency": {precision: {
                "eff_max": eff_max, "b_half": b_half,
                "source": (f"measured {when}: {what} train step {t1 * 1e3:.1f} ms at batch {b1}, "
                           f"{t2 * 1e3:.1f} ms at {b2}, in {nproc} processes at once; valid for this model")}},
            "default_intra": "loopback"}},
        "links": {"loopback": {
            "alpha_us": alpha * 1e6, "bandwidth_gbs": bw / 1e9,
            "source": f"measured {when}: gloo all-reduce over {nproc} processes on 127.0.0.1, sizes {xs}, "
                      f"times {[round(y * 1e3, 3) for y in ys]} ms"}},
    }


def write(entries: dict[str, Any], path: Path | None = None) -> Path:
    """Step 5: merge `entries` into the user catalog file and return its path."""
    path = Path(path) if path else user_catalog_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    old: dict[str, Any] = read_user_catalog(path)
    for section, items in entries.items():
        old[section] = {**(old.get(section) or {}), **items}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(old, sort_keys=False))
    tmp.replace(path)
    clear_cache()
    return path
