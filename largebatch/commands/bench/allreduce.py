"""`largebatch bench allreduce`: bus bandwidth of each all-reduce algorithm beside the backend's own.

1. Launch: not under torchrun, start ``--nproc`` local workers with
   ``torch.distributed.run`` (gloo on 127.0.0.1, or NCCL when CUDA is visible) running
   this same command; under torchrun (e.g. inside ``largebatch emulate hosts``) use
   the existing world. One launch path, as everywhere in largebatch.
2. For each size (``--sizes 4KB:64MB`` = powers of 4 from 4 KB to 64 MB, or a comma
   list) and each algorithm: a float32 tensor of that many bytes, ``--warmup``
   untimed calls (the first creates any sub-groups), a barrier, then the timed
   region covers exactly ``iters`` back-to-back all-reduces (CUDA: synchronised at
   the end). The time is the slowest rank's mean (taken after the timed region), and
   the median over calls of the slowest rank's per-call time (robust to a shared machine).
   ``--rounds`` repeats the sweep over the algorithms, interleaved, and reports the median
   round (a drift of the machine's speed then hits every algorithm alike).
3. Report in the nccl-tests convention: algbw = bytes / time, busbw = algbw * 2(p-1)/p,
   and busbw relative to ``native`` at the same size.
4. Predict each algorithm's time from measured *links*, not from its own timings
   (`largebatch.perf.measured`): time one p2p step (`largebatch.comm.p2p.exchange`, all
   ranks at once) on the intra-node ring and, with 2+ nodes, across nodes, for message
   sizes 1 KB .. half the largest size; fit alpha and bandwidth per link; time ``add_``
   for gamma; then `largebatch.perf`'s cost function of each algorithm on that
   topology gives the prediction, printed beside the measured mean with the error.
5. Rank 0 writes ``--json`` (all rows, links, errors, command, machine, load) and
   ``--plot`` (busbw against size, matplotlib Agg).

``--training``: instead of 2.-4., run the same DDP training steps (a small ResNet-18
on synthetic images, bucket ``--bucket-mb``) with DDP's own all-reduce, with each
algorithm as comm hook and with the ``noop`` hook, and report the exposed
communication time per step, t(hook) - t(noop) (`measure_training`).
"""
from __future__ import annotations

import io
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from largebatch import comm
from largebatch.comm.options import pieces_default
from largebatch.commands.bench import machine
from largebatch.checkpoint import atomic_write
from largebatch.cli import ArgumentParser, check_numbers, check_output_path
from largebatch.perf import measured as cost
from largebatch.comm.options import ALLREDUCE, DEFAULT_IMPL, IMPLS, TWO_LEVEL
from largebatch.errors import UserError

UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DEFAULT_ALGORITHMS = [*(a for a in ALLREDUCE if a not in TWO_LEVEL), *(f"{a}:{i}" for i in IMPLS for a in TWO_LEVEL)]


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not m:
        raise UserError(f"size {text!r} is not a byte count like 4KB, 16MB or 1048576.")
    value = int(float(m.group(1)) * UNITS[m.group(2)])
    if value < 4:
        raise UserError(f"size {text!r} is smaller than one float32 (4 bytes); give at least 4B.")
    return value


def parse_sizes(text: str) -> list[int]:
    """``LO:HI`` (powers of 4 from LO up to HI), ``LO:HI:FACTOR``, or a comma list."""
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise UserError(f"--sizes {text!r} must be LO:HI, LO:HI:FACTOR or a comma list, e.g. 4KB:64MB.")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        if len(parts) == 3 and not parts[2].isdigit():
            raise UserError(f"--sizes {text!r}: FACTOR {parts[2]!r} is not an integer; give an integer FACTOR >= 2.")
        factor = int(parts[2]) if len(parts) == 3 else 4
        if hi < lo or factor < 2:
            raise UserError(f"--sizes {text!r}: need LO <= HI and an integer FACTOR >= 2.")
        out = [lo]
        while out[-1] * factor <= hi:
            out.append(out[-1] * factor)
        return out
    return [parse_size(s) for s in text.split(",") if s.strip()]


def human(nbytes: float) -> str:
    for unit in ("GB", "MB", "KB"):
        if nbytes >= UNITS[unit]:
            return f"{nbytes / UNITS[unit]:g}{unit}"
    return f"{int(nbytes)}B"


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="largebatch bench allreduce", description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4, help="local worker processes when not under torchrun")
    ap.add_argument("--algorithms", nargs="+", default=DEFAULT_ALGORITHMS,
                    help="algorithms to run (native is always added as the reference); torus2d and hierarchical "
                         f"take :p2p or :native for their implementation (default {DEFAULT_IMPL}; "
                         "hierarchical:native also crosses nodes with the backend's all-reduce)")
    ap.add_argument("--compression", default="none", choices=["none", "fp16", "bf16"],
                    help="wire format of the reduced tensors (fp16/bf16 halve the bytes sent; default none)")
    ap.add_argument("--sizes", default="4KB:64MB", help="LO:HI[:FACTOR] or a comma list (bytes, KB, MB, GB)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per size (default: by size)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations per size")
    ap.add_argument("--grid", default=None, help="torus2d grid XxY (default: processes per node x nodes)")
    ap.add_argument("--local-size", type=int, default=None, help="hierarchical processes per node")
    ap.add_argument("--pipeline", type=int, default=None,
                    help=f"torus2d/hierarchical pieces overlapped across levels (default {pieces_default()}; 1 = off)")
    ap.add_argument("--small-bytes", type=int, default=None,
                    help="p2p algorithms hand tensors below this many bytes to native (default: "
                         f"{comm.SMALL_BYTES}, i.e. {human(comm.SMALL_BYTES)}; 0 = always run the algorithm itself)")
    ap.add_argument("--json", default=None, help="write the results here (rank 0)")
    ap.add_argument("--plot", default=None, help="write a PNG of busbw against size here (rank 0)")
    ap.add_argument("--training", action="store_true", help="exposed comm time per DDP training step instead")
    ap.add_argument("--steps", type=int, default=3, help="--training: timed steps per hook")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds over the algorithms, per size or (--training) per hook; median reported")
    ap.add_argument("--batch", type=int, default=16, help="--training: images per worker per step")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="--training: DDP bucket_cap_mb")
    ap.add_argument("--width", type=int, default=32, help="--training: ResNet-18 width (channels of stage 1)")
    return ap


def _validate(args: Any) -> None:
    if args.nproc < 2:
        raise UserError(f"--nproc {args.nproc}: an all-reduce needs at least 2 processes.")
    if not _under_torchrun():
        from largebatch.launch import check_worker_count

        check_worker_count("--nproc", args.nproc, low=2)
    for name in args.algorithms:
        base, impl = split_name(name)
        comm.resolve(base, impl_options(base, impl))
    if args.iters is not None and args.iters < 1:
        raise UserError("--iters must be at least 1.")
    args.size_list = parse_sizes(args.sizes)
    if not args.size_list:
        raise UserError(f"--sizes {args.sizes!r} names no size; e.g. 4KB:64MB.")
    check_numbers(("--warmup", args.warmup, args.warmup >= 0, "0 or more"),
                  ("--rounds", args.rounds, args.rounds >= 1, "1 or more"),
                  ("--steps", args.steps, args.steps >= 1, "1 or more"),
                  ("--batch", args.batch, args.batch >= 1, "1 or more"),
                  ("--bucket-mb", args.bucket_mb, 0 < args.bucket_mb < math.inf, "a positive size in MB"),
                  ("--width", args.width, args.width >= 1, "1 or more channels"),
                  ("--pipeline", args.pipeline, args.pipeline is None or args.pipeline >= 1,
                   "1 or more pieces (1 turns the overlap of the two levels off), or leave it out"),
                  ("--small-bytes", args.small_bytes, args.small_bytes is None or args.small_bytes >= 0,
                   "0 or more bytes (0 always runs the algorithm itself)"),
                  ("--local-size", args.local_size, args.local_size is None or args.local_size >= 1,
                   "1 or more processes per node"))
    _check_layout_flags(args)
    if not _under_torchrun():   # before the workers measure anything: their folder must take files
        for flag, path in (("--json", args.json), ("--plot", getattr(args, "plot", None))):
            check_output_path(flag, path)


def _check_layout_flags(args: Any) -> None:
    """--grid and --local-size before the workers start: found by each worker's comm setup, they were named as
    config keys (comm.grid, comm.local_size) once per worker, after the launch."""
    from largebatch.comm.topology import parse_grid

    positions = None
    if args.grid is not None:
        x, y = parse_grid(args.grid, "--grid")
        positions = x * y
    if _under_torchrun():   # the world is the launcher's; the workers check the layout against it
        return
    used = {split_name(name)[0] for name in args.algorithms}
    if positions is not None and "torus2d" in used and positions != args.nproc:
        raise UserError(f"--grid {args.grid} has {positions} positions but --nproc is "
                        f"{args.nproc}; give a grid XxY with X*Y = {args.nproc}.")
    if args.local_size is not None and "hierarchical" in used and args.nproc % args.local_size:
        raise UserError(f"--local-size {args.local_size} does not divide --nproc {args.nproc} into equal nodes; give "
                        f"a divisor of {args.nproc}.")


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    _validate(args)
    if not _under_torchrun():                                                   # 1. launch
        from largebatch.launch import local_workers, run_agent, without_options

        return run_agent(local_workers(args.nproc, ["bench", "allreduce", *without_options(argv, "--nproc")]))[0]
    from largebatch import dist as ldist

    device = ldist.pick_device("auto")   # cuda:LOCAL_RANK, current, before the group
    info = ldist.init(device)
    ldist.set_threads(None, info.local_world_size)
    try:
        if args.training:
            rows = measure_training(args.algorithms, steps=args.steps, rounds=args.rounds, batch=args.batch, bucket_mb=args.bucket_mb,
                                    width=args.width, compression=args.compression, device=device)
            if info.is_main:
                _print_training(rows, info.world_size)
                ddp = next(r["exposed_ms"] for r in rows if r["hook"] == "ddp")
                _write_json(args, {"training": rows, "world_size": info.world_size, "ddp_exposed_ms": ddp,
                                   "exposed_ms": {r["hook"]: r["exposed_ms"] for r in rows}})
        else:
            rows = measure(args, device, info.world_size)
            links = measure_links(args, device, info.world_size, info.local_world_size)
            if info.is_main:
                fits = _predict(rows, links, info.world_size, info.local_world_size, args)
                _print_table(rows, fits, links, info.world_size, args)
                _write_json(args, {"rows": rows, "fits": fits, "links": links, "world_size": info.world_size,
                                   "nodes": info.num_nodes, "local_world_size": info.local_world_size})
                if args.plot:
                    _plot(rows, args.plot, info.world_size, info.num_nodes)
    finally:
        ldist.shutdown()
    return 0


def split_name(name: str) -> tuple[str, str | None]:
    """``torus2d:native`` -> (``torus2d``, ``native``): an algorithm and its implementation (``impl``)."""
    base, _, impl = name.partition(":")
    return base, impl or None


def impl_options(name: str, impl: str | None) -> dict[str, Any]:
    """The options of an implementation: hierarchical:native runs every step, the cross-node one too, as
    the backend's collectives."""
    if not impl:
        return {}
    return {"impl": impl, **({"inter": "native"} if name == "hierarchical" and impl == "native" else {})}


def _options(name: str, args: Any) -> dict[str, Any]:
    name, impl = split_name(name)
    opts: dict[str, Any] = {"compression": args.compression, **impl_options(name, impl)}
    if name != "native":
        opts["small_bytes"] = args.small_bytes
    if name == "torus2d":
        opts["grid"] = args.grid
    if name == "hierarchical":
        opts["local_size"] = args.local_size
    if name in ("torus2d", "hierarchical"):
        opts["pipeline"] = args.pipeline
    return opts


def _iters(size: int) -> int:
    return max(3, min(50, (64 << 20) // size))


def _timed(call: Any, iters: int, device: torch.device) -> tuple[float, float]:
    """``iters`` back-to-back calls: (mean, median) seconds per call of the slowest rank.

    The mean is the nccl-tests figure (one timed region). The median of the per-call times
    (the slowest rank per call) is what a typical call costs when the machine is shared: a few
    calls that wait for a time slice do not move it. On CUDA the per-call clock reads would not
    wait for the device, so there the median is the mean.
    """
    stamps = [0.0] * iters
    t0 = time.perf_counter()
    for j in range(iters):
        call()
        stamps[j] = time.perf_counter()                                # a clock read, no device sync
    if device.type == "cuda":
        torch.cuda.synchronize()
        stamps = [t0 + (time.perf_counter() - t0) * (j + 1) / iters for j in range(iters)]
    per_call = torch.tensor([b - a for a, b in zip([t0] + stamps, stamps)] + [stamps[-1] - t0],
                            dtype=torch.float64)
    dist.all_reduce(per_call, op=dist.ReduceOp.MAX)                    # host sync, outside the timed region
    total = float(per_call[-1])
    return total / iters, float(per_call[:-1].median())


def measure(args: Any, device: torch.device, p: int) -> list[dict[str, Any]]:
    """Step 2: one row per (algorithm, size) with the slowest rank's seconds per call.

    ``--rounds`` sweeps of all algorithms per size, interleaved (native, ring, ..., native, ring,
    ...), so that a change of the machine's speed during a size hits every algorithm alike; the
    row holds the median over rounds of each round's mean (and of its median), and every round's
    mean in ``round_times_s``.
    """
    names = ["native"] + [a for a in args.algorithms if a != "native"]
    rows = []
    for size in args.size_list:
        x = torch.zeros(size // 4, dtype=torch.float32, device=device)    # zeros: values never overflow
        iters = args.iters or _iters(size)
        means: dict[str, list[float]] = {n: [] for n in names}
        medians: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(max(1, args.rounds)):
            for name in names:
                opts = _options(name, args)
                base = split_name(name)[0]
                for _ in range(args.warmup):
                    comm.allreduce(x, base, **opts)
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t, med = _timed(lambda: comm.allreduce(x, base, **opts), iters, device)
                means[name].append(t)
                medians[name].append(med)
        for name in names:
            t, med = statistics.median(means[name]), statistics.median(medians[name])
            algbw = x.numel() * 4 / t
            rows.append({"algorithm": name, "compression": args.compression, "bytes": x.numel() * 4,
                         "iters": iters, "rounds": len(means[name]), "time_s": t, "median_s": med,
                         "round_times_s": means[name], "algbw_GBps": algbw / 1e9,
                         "busbw_GBps": algbw * 2 * (p - 1) / p / 1e9})
    return rows


def _step_time(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, iters: int) -> float:
    """Mean seconds per `exchange` step (slowest rank), all ranks at once.

    The mean, not the median: on the tbf-shaped cluster link a fit to the medians gave a bandwidth
    above the configured rate (0.179 GB/s on a 0.125 GB/s link; cause not established).
    """
    from largebatch.comm.p2p import exchange

    exchange(send, dst, recv, src, None)                              # warm-up
    dist.barrier()
    return _timed(lambda: exchange(send, dst, recv, src, None), iters, send.device)[0]


def measure_links(args: Any, device: torch.device, p: int, k: int) -> dict[str, Any]:
    """Step 4a: step times on the intra-node ring and across nodes, and ``add_`` times, fitted per link."""
    rank = dist.get_rank()
    top = max(args.size_list) // 2
    sizes = [1024]
    while sizes[-1] * 4 <= top:
        sizes.append(sizes[-1] * 4)
    out: dict[str, Any] = {"message_bytes": sizes}
    node0 = rank - rank % k
    patterns = {}
    if k > 1:
        patterns["intra"] = (node0 + (rank + 1) % k, node0 + (rank - 1) % k, 1)
    if p > k:
        patterns["inter"] = ((rank + k) % p, (rank - k) % p, k)       # k flows leave each node
    for name, (dst, src, flows) in patterns.items():
        times = []
        for m in sizes:
            buf = torch.zeros(2, m // 4, dtype=torch.float32, device=device)
            times.append(_step_time(buf[0], dst, buf[1], src, _iters(4 * m)))
        link = cost.fit_link(name, sizes, times, flows)
        out[name] = {"alpha_s": link.alpha_s, "bandwidth_Bps": link.bandwidth_Bps, "flows": flows,
                     "step_times_s": times}
    add_times = []
    add_sizes = [m for m in sizes if m >= 64 << 10] or sizes[-1:]
    for m in add_sizes:                                               # gamma: every rank adds at once
        x = torch.ones(2, m // 4, dtype=torch.float32, device=device)
        dist.barrier()
        add_times.append(_timed(lambda: x[0].add_(x[1]), _iters(4 * m), device)[0])
    out["gamma_s_per_byte"] = cost.fit_gamma(add_sizes, add_times)
    out["add_times_s"] = dict(zip(map(str, add_sizes), add_times))
    return out


def _predict(rows: list[dict[str, Any]], links: dict[str, Any], p: int, k: int, args: Any) -> dict[str, dict]:
    """Step 4b: each row's predicted time from the measured links; max relative error per algorithm."""
    from largebatch.comm import SMALL_BYTES
    from largebatch.perf.catalog import Link

    def link(name: str) -> Optional[Link]:
        f = links.get(name)
        return Link(name, f["alpha_s"], f["bandwidth_Bps"]) if f else None

    import torch.distributed as dist

    intra = link("intra") or link("inter")
    assert intra is not None   # 2 or more ranks: measure_links fitted intra (k > 1) or inter (p > k)
    topo = cost.topology(p, k, intra, link("inter"), links["gamma_s_per_byte"])
    backend = "nccl" if dist.is_initialized() and dist.get_backend() == "nccl" else "gloo"
    small = SMALL_BYTES if args.small_bytes is None else args.small_bytes
    fits: dict[str, dict] = {}
    for r in rows:
        full = r["algorithm"]
        name, impl = split_name(full)     # the native-composed form makes the same steps in its own pieces
        if name == "hierarchical" and args.local_size not in (None, k):
            r["predicted_s"] = None                                   # no model for a non-physical node size
            continue
        r["predicted_s"] = cost.predict(name, r["bytes"], topo, grid=args.grid if name == "torus2d" else None,
                                        small_bytes=0 if name == "native" else small, pipeline=args.pipeline,
                                        backend=backend, impl=impl or DEFAULT_IMPL)
        r["error"] = r["predicted_s"] / r["time_s"] - 1
        r["error_vs_median"] = r["predicted_s"] / r["median_s"] - 1
        f = fits.setdefault(full, {"max_abs_error": 0.0, "within_25pct": 0, "points": 0})
        f["max_abs_error"] = max(f["max_abs_error"], abs(r["error"]))
        f["points"] += 1
        f["within_25pct"] += abs(r["error"]) <= 0.25
    return fits


def _print_table(rows: list[dict[str, Any]], fits: dict, links: dict, p: int, args: Any) -> None:
    native = {r["bytes"]: r["busbw_GBps"] for r in rows if r["algorithm"] == "native"}
    print(f"# all-reduce, {p} processes, float32, compression={args.compression}; busbw = algbw * 2(p-1)/p; "
          f"pred = largebatch.perf cost on the measured links")
    print(f"{'size':>8} {'algorithm':>17} {'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} "
          f"{'vs native':>9} {'median(us)':>10} {'pred(us)':>10} {'error':>7}")
    for r in rows:
        pred = r.get("predicted_s")
        tail = f"{pred * 1e6:>10.1f} {r['error']:>+7.0%}" if pred is not None else f"{'-':>10} {'-':>7}"
        print(f"{human(r['bytes']):>8} {r['algorithm']:>17} {r['time_s'] * 1e6:>11.1f} {r['algbw_GBps']:>12.3f} "
              f"{r['busbw_GBps']:>12.3f} {r['busbw_GBps'] / native[r['bytes']]:>9.2f} {r['median_s'] * 1e6:>10.1f} {tail}")
    print("# links (one exchange step, all ranks at once; fitted alpha + flows * m / B: B from >= 1 MB, alpha from < 64 KB)")
    for name in ("intra", "inter"):
        if name in links:
            f = links[name]
            print(f"{name:>17}: alpha = {f['alpha_s'] * 1e6:8.1f} us, B = {f['bandwidth_Bps'] / 1e9:7.3f} GB/s "
                  f"per flow-share ({f['flows']} flow(s) per node in the measured step)")
    g = links["gamma_s_per_byte"]
    print(f"{'gamma (add_)':>17}: {g * 1e9:.3f} ns/byte = {(1 / g / 1e9 if g else float('inf')):.2f} GB/s")
    print("# load average (1, 5, 15 min): " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    print("# prediction error per algorithm (against the mean per call)")
    for name, f in fits.items():
        print(f"{name:>17}: max |pred/measured - 1| = {f['max_abs_error']:.0%}, "
              f"{f['within_25pct']}/{f['points']} sizes within 25%")


def _write_json(args: Any, payload: dict[str, Any]) -> None:
    if not args.json:
        return
    payload = {"command": "largebatch bench allreduce " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "allreduce"] else sys.argv[1:]),
               "machine": machine(torch.device("cuda" if torch.cuda.is_available() else "cpu")), "load_average_1_5_15": list(os.getloadavg()), **payload}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(Path(args.json), json.dumps(payload, indent=1).encode())   # whole or absent


def _plot(rows: list[dict[str, Any]], path: str, p: int, nodes: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    for name in dict.fromkeys(r["algorithm"] for r in rows):
        mine = [r for r in rows if r["algorithm"] == name]
        ax.plot([r["bytes"] for r in mine], [r["busbw_GBps"] for r in mine], marker="o", ms=3, label=name,
                linestyle="--" if name == "native" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["bytes"] for r in rows if r["algorithm"] == "native"],
                  [human(r["bytes"]) for r in rows if r["algorithm"] == "native"], fontsize=7)
    ax.set_xlabel("message size")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"all-reduce busbw, {nodes} node(s) x {p // max(1, nodes)} processes, gloo ({machine(torch.device('cpu'))})", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix[1:] or "png")
    plt.close(fig)
    atomic_write(Path(path), buf.getvalue())   # whole or absent


# ---------------------------------------------------------------------------------------------
# --training: exposed communication time per DDP step

def _model(width: int) -> torch.nn.Module:
    from largebatch.models import build_model

    return build_model("resnet18", num_classes=10, in_channels=3, stem="small", width=width)


def measure_training(algorithms: list[str], steps: int = 6, batch: int = 16, bucket_mb: float = 25.0,
                     width: int = 32, compression: str = "none", image_size: int = 32,
                     device: Optional[torch.device] = None, warmup: int = 2,
                     rounds: int = 3) -> list[dict[str, Any]]:
    """Seconds per DDP training step with DDP's own all-reduce ("ddp"), each hook and ``noop``.

    Collective: call on every rank. Returns rows ``{"hook", "step_s", "exposed_comm_s"}``
    with exposed = t(hook) - t(noop): per round, the slowest rank's mean over ``steps``
    timed steps; rounds interleave the hooks, each round in a rotated order (the same on every rank), so that no
    hook always runs right after another; ``step_s`` is the median round and ``exposed_comm_s`` the median
    over rounds of the round's difference to ``noop`` (paired, so that a load drift between rounds cancels).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from largebatch.optim import SGD
    from largebatch.step import LocalStep, local_step

    device = device or torch.device("cpu")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 3, image_size, image_size, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    hooks = ["noop", "ddp"] + [a for a in algorithms]
    runs = []
    for hook in hooks:                              # every rank builds and registers in the same order
        torch.manual_seed(0)
        net = _model(width).to(device)
        ddp = DDP(net, bucket_cap_mb=bucket_mb, device_ids=[device.index] if device.type == "cuda" else None)
        base, impl = split_name(hook)
        opts = impl_options(base, impl)
        state = None if hook == "ddp" else comm.register(ddp, comm.CommHookState(base, compression=compression, **opts))
        # the product's step (largebatch.step) with its fused SGD, through this DDP module and its hook
        runs.append((hook, ddp, state, local_step(net, SGD(net.parameters(), lr=0.01, momentum=0.9),
                                                  device=device, ddp=ddp, world_size=dist.get_world_size())))

    def step(train: LocalStep) -> None:
        train([(x, y)], 0.01)

    for _, _, _, train in runs:
        for _ in range(warmup):
            step(train)
    samples: dict[str, list[float]] = {h: [] for h in hooks}
    for i in range(rounds):     # interleaved rounds (load drifts hit every hook alike), each in a rotated order
        for hook, _, _, train in runs[i % len(runs):] + runs[:i % len(runs)]:   # so no hook always follows another
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(train)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)           # host sync, outside the timed region
            samples[hook].append(float(elapsed.item()))
    grad_mb = sum(q.numel() * q.element_size() for q in runs[0][1].parameters()) / 2**20
    for _, _, state, _ in runs:
        if state is not None:
            state.close()
    rows: list[dict[str, Any]] = []
    for hook in hooks:
        rows.append({"hook": hook, "compression": compression if hook not in ("ddp", "noop") else "none",
                     "step_s": statistics.median(samples[hook]), "samples_s": samples[hook],
                     "gradient_MB": grad_mb})
    for r in rows:   # paired: each round's t(hook) - t(noop), so a drift between rounds cancels; median of them
        per_round = [h - n for h, n in zip(samples[r["hook"]], samples["noop"])]
        r["exposed_rounds_ms"] = [1e3 * e for e in per_round]
        r["exposed_comm_s"] = statistics.median(per_round)
        r["exposed_ms"] = 1e3 * r["exposed_comm_s"]
    return rows


def _print_training(rows: list[dict[str, Any]], p: int) -> None:
    print(f"# DDP training step, ResNet-18 ({rows[0]['gradient_MB']:.1f} MB of gradients), {p} processes; "
          f"exposed comm = t(hook) - t(noop)")
    ddp = next(r["exposed_comm_s"] for r in rows if r["hook"] == "ddp")
    print(f"{'hook':>19} {'step(ms)':>10} {'exposed comm(ms)':>17} {'vs ddp':>7}")
    for r in rows:
        ratio = f"{r['exposed_comm_s'] / ddp:>7.2f}" if ddp > 0 and r["hook"] != "noop" else f"{'':>7}"
        print(f"{r['hook']:>19} {r['step_s'] * 1e3:>10.1f} {r['exposed_comm_s'] * 1e3:>17.1f} {ratio}")
