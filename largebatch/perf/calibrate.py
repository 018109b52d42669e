"""`largebatch plan --calibrate`: measure this machine and store a "this-machine" catalog entry.

On the device at hand: the GPU where CUDA is available (`device="auto"`), else the CPU. Runs `nproc` real
worker processes (CPU: gloo on 127.0.0.1, each with cores // nproc threads, so the measurement sees the same
sharing of cores as an `nproc`-process training run; GPU: one GPU per process, NCCL):

1. Peak: a timed matmul (n x n x n, 2n^3 FLOPs) in every worker at once; the median rate (CPU: fp32; GPU: in
   the run's precision, TF32 for fp32).
2. Compute curve: largebatch's training step (forward, backward, fused SGD) of the model at two per-device batches b1 < b2
   in every worker at once (no communication; GPU: autocast in the precision, channels_last); the medians
   t1, t2 fit t(b) = t_img (b + b_half):
   t_img = (t2 - t1) / (b2 - b1), b_half = t1 / t_img - b1, eff_max = 3F / (peak t_img).
3. Memory bandwidth: a timed copy of a 16 MB tensor (CPU) or 1 GB (GPU) (read + write).
4. Link: all-reduce times T(S) for a few message sizes S; for p ranks on one ring
   T = 2(p-1) alpha + 2(p-1)/p S beta: the slope b between the two largest sizes gives
   bandwidth = 2(p-1) / (p b), the smallest size gives alpha = (T - b S) / (2(p-1)). CPU: `loopback`
   (gloo); GPU: `this-machine-gpus` (NCCL between this machine's GPUs; none with one process).
5. Write `devices.this-machine` and the link to the user catalog file (never the package).
"""
from __future__ import annotations

import datetime
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from largebatch.checkpoint import atomic_write
from largebatch.dist import end_process
from largebatch.errors import UserError
from largebatch.launch import free_port
from largebatch.perf.catalog import clear_cache, read_user_catalog, user_catalog_path
from largebatch.perf.flops import model_cost


def _timed(fn, reps: int, device: torch.device = torch.device("cpu")) -> float:
    """Median seconds of `reps` calls after one warm-up call (on a GPU: waiting for the device each time)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def resolve_device(device: str = "auto") -> str:
    """"cuda" or "cpu" for `device` ("auto": the GPU where CUDA is available); cuda without CUDA is one sentence."""
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"calibration device {device!r} is not one of auto, cpu, cuda.")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("calibration on cuda needs a CUDA device, and torch sees none here; calibrate on cpu.")
    return device


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _worker(rank: int, world: int, port: int, spec: dict[str, Any], results: str) -> None:
    from largebatch.models import build_model
    from largebatch.optim import SGD
    from largebatch.rundir import watch_parent
    from largebatch.step import local_step

    watch_parent(spec["parent"])   # a killed `plan --calibrate` takes its measuring workers with it

    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True    # the catalog's fp32 on a GPU is TF32 (its tensor-core peak)
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(spec["threads"])
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        out: dict[str, Any] = {}
        reps = spec["reps"]
        n = spec["matmul_n"]  # 1.
        dtype = DTYPES.get(spec["precision"])
        mm_dtype = dtype if cuda and dtype is not None else torch.float32
        a = torch.randn(n, n, device=device, dtype=mm_dtype)
        b = torch.randn(n, n, device=device, dtype=mm_dtype)
        dist.barrier()
        out["matmul_s"] = _timed(lambda: torch.mm(a, b), reps, device)
        torch.manual_seed(0)  # 2.
        model = build_model(spec["model"], spec["num_classes"], in_channels=spec["in_channels"],
                            stem=spec["stem"], width=spec["width"]).to(device)
        fmt = torch.channels_last if cuda else torch.contiguous_format
        model = model.to(memory_format=fmt)  # type: ignore[call-overload]  # Module.to takes it; the stubs omit it
        model.train()
        # the product's step (largebatch.step: autocast, the fp16 loss scale, the finiteness verdict) with its
        # fused SGD, on one worker's model: no communication in the compute curve
        step = local_step(model, SGD(model.parameters(), lr=0.01, momentum=0.9), device=device,
                          precision=spec["precision"], channels_last=cuda)
        for key, bsz in (("t1", spec["b1"]), ("t2", spec["b2"])):
            x = torch.randn(bsz, spec["in_channels"], spec["image_size"], spec["image_size"],
                            device=device).contiguous(memory_format=fmt)
            y = torch.randint(0, spec["num_classes"], (bsz,), device=device)
            dist.barrier()
            out[key] = _timed(lambda: step([(x, y)], 0.01), reps, device)
        src = torch.empty(spec["copy_bytes"], dtype=torch.uint8, device=device)  # 3.
        dst = torch.empty_like(src)
        out["copy_s"] = _timed(lambda: dst.copy_(src), reps, device)
        out["allreduce"] = {}
        for size in spec["sizes"]:  # 4.
            t = torch.zeros(size // 4, device=device)
            dist.barrier()
            out["allreduce"][size] = _timed(lambda: dist.all_reduce(t), reps, device)
        with open(Path(results) / f"{rank}.pkl", "wb") as f:   # our own file, read back by measure()
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()
    end_process(0, ran_group=True)   # the gloo worker's exit without interpreter finalization (dist.end_process)


# per device kind: (b1, b2, matmul n, copy bytes, all-reduce sizes, processes)
DEFAULTS = {"cpu": (32, 128, 1024, 16 * 2**20, (2**12, 2**20, 2**22, 2**24), 2),
            "gpu": (64, 256, 8192, 2**30, (2**12, 2**20, 2**24, 2**26), 1)}


def measure(model: str = "resnet18", image_size: int = 28, in_channels: int = 1, num_classes: int = 10,
            stem: str = "small", width: int = 16, precision: str = "fp32", nproc: int | None = None,
            b1: int | None = None, b2: int | None = None, reps: int = 5, matmul_n: int | None = None,
            sizes: tuple[int, ...] | None = None, device: str = "auto") -> dict[str, Any]:
    """Steps 1-4 in `nproc` real processes on the device at hand; returns the catalog entries (not yet written)."""
    device = resolve_device(device)
    cuda = device == "cuda"
    d_b1, d_b2, d_n, copy_bytes, d_sizes, d_nproc = DEFAULTS["gpu" if cuda else "cpu"]
    b1, b2, matmul_n = b1 or d_b1, b2 or d_b2, matmul_n or d_n
    sizes, nproc = tuple(sizes or d_sizes), nproc or d_nproc
    if cuda and nproc > torch.cuda.device_count():
        raise UserError(f"--nproc {nproc} needs {nproc} GPUs, but this machine has {torch.cuda.device_count()}; "
                        "give at most that many (one process per GPU).")
    if cuda and precision not in DTYPES and precision != "fp32":
        raise UserError(f"precision {precision!r} is not one of fp32, fp16, bf16.")
    threads = max(1, (os.cpu_count() or 1) // nproc)
    spec = dict(model=model, image_size=image_size, in_channels=in_channels, num_classes=num_classes, stem=stem,
                width=width, precision=precision, b1=b1, b2=b2, reps=reps, matmul_n=matmul_n, sizes=list(sizes),
                threads=threads, device=device, copy_bytes=copy_bytes, parent=os.getpid())
    # results through files, not a multiprocessing.Manager: its server process is forked from this one and, like
    # the workers before they watched their parent, outlived a killed calibration
    with tempfile.TemporaryDirectory(prefix="largebatch-calibrate-") as results:
        mp.spawn(_worker, args=(nproc, free_port(), spec, results), nprocs=nproc, join=True)
        res = []
        for r in range(nproc):
            with open(Path(results) / f"{r}.pkl", "rb") as f:
                res.append(pickle.load(f))
    return entries(res, spec)


def entries(res: list[dict[str, Any]], spec: dict[str, Any], when: str | None = None,
            gpu_name: str | None = None) -> dict[str, Any]:
    """The catalog entries from the workers' timings `res` (pure arithmetic; `measure` calls it)."""
    nproc, b1, b2, precision = len(res), spec["b1"], spec["b2"], spec["precision"]
    cuda = spec["device"] == "cuda"
    med = lambda key: statistics.median(r[key] for r in res)  # noqa: E731
    peak = 2.0 * spec["matmul_n"]**3 / med("matmul_s")
    t1, t2 = med("t1"), med("t2")
    t_img = max((t2 - t1) / (b2 - b1), 1e-12)
    b_half = max(0.0, t1 / t_img - b1)
    model, stem, width = spec["model"], spec["stem"], spec["width"]
    in_channels, image_size = spec["in_channels"], spec["image_size"]
    flops = model_cost(model, image_size, in_channels, spec["num_classes"], stem, width).forward_flops
    eff_max = 3.0 * flops / (peak * t_img)
    mem_gbs = 2.0 * spec["copy_bytes"] / med("copy_s") / 1e9
    xs = list(spec["sizes"])
    ys = [statistics.median(r["allreduce"][s] for r in res) for s in xs]
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 1e-15)   # bandwidth from the two largest sizes
    p = nproc
    alpha = max(0.0, ys[0] - slope * xs[0]) / (2 * (p - 1)) if p > 1 else 0.0  # latency from the smallest
    bw = 2 * (p - 1) / (p * max(slope, 1e-15)) if p > 1 else 1e12
    when = when or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    what = f"{model} ({stem} stem, width {width}, {in_channels}x{image_size}x{image_size}, {precision})"
    if cuda:
        gpu = gpu_name or torch.cuda.get_device_name(0)
        name = f"this machine: {gpu}, {nproc} process(es), one GPU each"
        mm = f"{precision if precision != 'fp32' else 'tf32'} matmul {spec['matmul_n']}^3 on {gpu}"
        link, link_src = "this-machine-gpus", f"NCCL all-reduce over {nproc} GPUs of this machine"
        copy = f"{spec['copy_bytes'] / 2**20:.0f} MB device copy"
    else:
        name = f"this machine: one of {nproc} processes with {spec['threads']} thread(s)"
        mm = f"fp32 matmul {spec['matmul_n']}^3"
        link, link_src = "loopback", f"gloo all-reduce over {nproc} processes on 127.0.0.1"
        copy = f"{spec['copy_bytes'] / 2**20:.0f} MB tensor copy"
    peaks = {precision: peak / 1e12} if cuda or precision == "fp32" else {precision: peak / 1e12, "fp32": peak / 1e12}
    out: dict[str, Any] = {
        "devices": {"this-machine": {
            "name": name,
            "peak_tflops": peaks,
            "peak_source": f"measured {when}: {mm} in {nproc} processes at once",
            "memory_gbs": mem_gbs,
            "memory_source": f"measured {when}: {copy}",
            "efficiency": {precision: {
                "eff_max": eff_max, "b_half": b_half,
                "source": (f"measured {when}: {what} train step {t1 * 1e3:.1f} ms at batch {b1}, "
                           f"{t2 * 1e3:.1f} ms at {b2}, in {nproc} processes at once; valid for this model")}},
            "default_intra": link if (p > 1 or not cuda) else "none"}}}
    if p > 1 or not cuda:
        out["links"] = {link: {
            "alpha_us": alpha * 1e6, "bandwidth_gbs": bw / 1e9,
            "source": f"measured {when}: {link_src}, sizes {xs}, times {[round(y * 1e3, 3) for y in ys]} ms"}}
    return out


def write(entries: dict[str, Any], path: Path | None = None) -> Path:
    """Step 5: merge `entries` into the user catalog file and return its path."""
    path = Path(path) if path else user_catalog_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    old: dict[str, Any] = read_user_catalog(path)
    for section, items in entries.items():
        old[section] = {**(old.get(section) or {}), **items}
    atomic_write(path, yaml.safe_dump(old, sort_keys=False).encode())   # whole or absent, the old one kept
    clear_cache()
    return path
