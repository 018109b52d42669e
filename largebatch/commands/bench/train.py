"""`largebatch bench train`: training images/s of largebatch's step beside a plain PyTorch loop, and the MFU.

Everything below runs in one process, in the same run, with the same threads (cores / local workers):

1. Peak: GFLOP/s of a large square matrix multiply (--peak-size, default 2048) in fp32 and in bf16, the
   best of several repetitions each. The machine's matmul peak is the faster of the two. On a CPU a dtype
   with no units of its own (bf16 on AVX2) is measured at the size one product takes half a second at.
2. Plain PyTorch: the same architecture (`build_model`, fresh weights), fp32, NCHW, eager, float input,
   ``torch.optim.SGD(momentum=0.9, weight_decay=1e-4)``: ``zero_grad; cross_entropy(model(x), y).backward();
   step`` -- the loop a user would write.
3. largebatch: per configuration (--configs, e.g. ``fp32``, ``fp32-cl``, ``bf16-cl``, ``fp32-cl-compile``,
   ``fp16-cl-graph``: precision, channels_last, torch.compile, the step as one CUDA graph, which is off
   unless named) a real `Trainer` on the synthetic source (world size 1), timed
   through `Trainer.train_step` (largebatch/step.py) on micro-batches from its own sampler and source: uint8 pixels until the
   model's Normalize, autocast, channels_last, the optimizer from `build_optimizer` (--optimizer; label
   smoothing --label-smoothing), no host sync. The product's step, not a separate loop. Its input is staged:
   two steps' micro-batches are drawn from the source once, in the model's memory format and, on CUDA, on
   the device (the trainer's prefetcher copies each step's batches there on a side stream a step ahead;
   `bench data` and an end-to-end run measure that part), and cycled.
   Drawing a 224 px batch in this process costs about as much as a GPU step (the in-memory source's
   per-pixel crop index: 50 ms of CPU per 256 images beside a 55 ms bf16 step on an H200), and it is the
   loader's work, which `bench data` measures.
   Peers (--peers timm,torchvision): those libraries' own `resnet50`-style models (the same name as
   --model) through one plain loop with each configuration's settings (autocast precision, channels_last,
   torch.compile, GradScaler for fp16), named ``timm:CONFIG`` and ``torchvision:CONFIG``. A peer that is not
   installed is reported as skipped; a ``-graph`` configuration is compared with the peers' loop of the same
   configuration without it (they have no graph of their own).
4. Timing: untimed warm-up steps per entry (one; graph.WARMUP + 2 where a CUDA graph is captured; and
   compilation), then --rounds rounds; in each round every
   entry runs --steps steps in turn, so a load change on a shared machine hits all of them alike; on CUDA
   each entry's steps end with a device synchronisation. Each entry's figure is its median round. On CUDA,
   fp32 means TF32 matmuls and convolutions for every entry alike (`torch.set_float32_matmul_precision("high")`).
5. Report: images/s per entry, the fastest largebatch configuration, its speedup over the plain loop, its
   ratio to --reference NAME=IMAGES_PER_S (e.g. MLPerf's per-GPU rate) where given, and
   MFU = images/s x 3 x forward FLOPs per image (`count_flops`; backward = 2 x forward) / peak, against
   the fp32 peak, the bf16 peak and the machine's peak. --json writes all of it.

Each entry stands alone: one that raises while it is built, warmed up or timed (a ``-graph`` configuration
whose capture fails, an out-of-memory error, any error) is left out of the later rounds and reported with its
error in one line (``{"error": ...}`` in --json's ``configs`` or ``peers`` and in ``errors``, and a line of
the table), while the other entries keep their figures: on a GPU machine lent for minutes, one configuration
must not cost the figures of the others. The command then exits 1, after the table and --json are written,
so that a script or a check that reads only the exit status cannot take a run with an entry missing for a
whole one. A configuration that cannot run here at all (fp16 or a graph without CUDA) is a command-line
error before anything is measured (exit 2), as before.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from largebatch.commands.bench import machine
from largebatch.commands.bench.baselines import peer_model, plain_step_fn, stem
from largebatch.checkpoint import atomic_write
from largebatch.cli import ArgumentParser, check_numbers, check_output_path
from largebatch.config import check_threads
from largebatch.errors import UserError

PRECISIONS = ("fp32", "bf16", "fp16")
PEERS = ("timm", "torchvision")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fitting_size(dtype: torch.dtype, size: int, min_time_s: float, probe: int = 256) -> int:
    """Step 1: `size`, halved until one product is timed at most `min_time_s` from a `probe`-sized one, and not
    below `probe`: a CPU dtype with no units of its own (bf16 on AVX2, 0.3 GFLOP/s) would take minutes at 2048."""
    if size <= probe:
        return size
    m = torch.randn(probe, probe, generator=torch.Generator().manual_seed(0)).to(dtype)
    torch.mm(m, m)
    t0 = time.perf_counter()
    torch.mm(m, m)
    per_probe = time.perf_counter() - t0
    while size > probe and per_probe * (size / probe) ** 3 > min_time_s:
        size //= 2
    return max(size, probe)


def matmul_peak_gflops(dtype: torch.dtype, size: int, min_time_s: float = 0.5,
                       device: torch.device = torch.device("cpu")) -> float:
    """Step 1: best GFLOP/s of `size` x `size` matmuls in `dtype` over at least `min_time_s` seconds."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device, dtype)
    b = torch.randn(size, size, generator=gen).to(device, dtype)
    torch.mm(a, b)   # warm-up: kernel selection, page faults
    _sync(device)
    best, spent, reps = 0.0, 0.0, 0
    inner = 10 if device.type == "cuda" else 1   # a GPU product takes microseconds: time several
    while spent < min_time_s or (reps < 3 and spent < 10 * min_time_s):   # slow dtypes: fewer repetitions
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b)
        _sync(device)
        dt = time.perf_counter() - t0
        spent += dt
        reps += 1
        best = max(best, inner * 2 * size ** 3 / dt / 1e9)
    return best


def parse_config(name: str) -> dict:
    """'bf16-cl-compile' -> {'precision': 'bf16', 'channels_last': True, 'compile': True, 'graph': False}; an
    ``autotune`` part compiles with Inductor's max-autotune-no-cudagraphs mode ('compile': that mode)."""
    parts = name.split("-")
    if (parts[0] not in PRECISIONS or not set(parts[1:]) <= {"cl", "compile", "autotune", "graph"}
            or len(set(parts[1:])) != len(parts[1:]) or {"compile", "autotune"} <= set(parts[1:])):
        raise UserError(f"--configs entry {name!r} is not PRECISION[-cl][-compile|-autotune][-graph] with PRECISION "
                        f"one of {', '.join(PRECISIONS)} (e.g. fp32-cl or bf16-cl-compile-graph).")
    for need in ("fp16", "graph"):
        if need in parts and not torch.cuda.is_available():
            raise UserError(f"--configs entry {name!r}: {need} needs a CUDA device; leave it out on CPU.")
    compile_: bool | str = "max-autotune-no-cudagraphs" if "autotune" in parts[1:] else "compile" in parts[1:]
    return {"precision": parts[0], "channels_last": "cl" in parts[1:], "compile": compile_, "graph": "graph" in parts[1:]}


def peer_config(name: str) -> str:
    """The peers' configuration for largebatch's `name`: the same, without a CUDA graph (they have none)."""
    return "-".join(p for p in name.split("-") if p != "graph")


def parse_reference(text: str | None) -> tuple[str, float] | None:
    """--reference NAME=IMAGES_PER_S -> (name, rate)."""
    if not text:
        return None
    name, _, rate = text.rpartition("=")
    try:
        value = float(rate)
    except ValueError:
        value = 0.0
    if not name or not value > 0:
        raise UserError(f"--reference is {text!r}; give NAME=IMAGES_PER_S, e.g. mlperf-v4.0-h200=7951.")
    return name, value


def largebatch_step_fn(args, spec: dict, run_dir: Path, device: torch.device = torch.device("cpu")
                       ) -> Callable[[], None]:
    """Step 3: a real Trainer, and a closure running one `train_step` on its next micro-batches."""
    from largebatch.config import from_dict
    from largebatch.trainer import Trainer

    cfg = from_dict({
        "model": {"name": args.model, "width": args.width, "stem": stem(args)},
        "data": {"dataset": "synthetic", "image_size": args.image_size, "num_classes": args.classes,
                 "synthetic_size": max(args.batch * 8, 256)},
        "batch": {"global_batch": args.batch},
        "optim": {"name": args.optimizer, "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4},
        "schedule": {"epochs": 1, "warmup_epochs": 0},
        "train": {"precision": spec["precision"], "channels_last": "on" if spec["channels_last"] else "off",
                  "compile": bool(spec["compile"]), "plots": False, "threads": args.threads, "device": device.type,
                  **({"compile_mode": spec["compile"]} if isinstance(spec["compile"], str) else {}),
                  "cuda_graph": "on" if spec.get("graph") else "off",
                  "label_smoothing": getattr(args, "label_smoothing", 0.0)},
    }, recipe="bench-train")
    trainer = Trainer(cfg, run_dir, quiet=True)
    phase = trainer.plan.phase_at(0)
    lr = trainer.plan.lr(0)
    state: dict[str, Any] = {"epoch": 0, "it": iter(())}
    train_data = trainer.train_data
    assert train_data is not None   # built by Trainer

    def next_micro() -> tuple[torch.Tensor, torch.Tensor]:
        for _ in range(2):
            try:
                return next(state["it"])
            except StopIteration:   # a new epoch of the synthetic source
                state["epoch"] += 1
                state["it"] = iter(train_data.batches(trainer.batches.micro_batches(state["epoch"], 0, phase),
                                                      train=True, epoch=state["epoch"]))
        raise RuntimeError("the synthetic source yielded no batches")

    fmt = torch.channels_last if trainer.channels_last else torch.contiguous_format
    staged = []
    for _ in range(2 * phase.accumulation):
        x, y = next_micro()
        x = x.contiguous(memory_format=fmt)
        staged.append((x.to(device), y.to(device)) if device.type == "cuda" else (x, y))
    turns = itertools.cycle(staged)

    def step() -> None:
        micros = [next(turns) for _ in range(phase.accumulation)]
        trainer.train_step(0, micros, phase, lr)   # no host sync: measure() synchronises per round
    # its parts, for scripts/gpu_step_profile.py and the tests
    step.parts = SimpleNamespace(trainer=trainer, next_micro=next_micro, staged=staged,  # type: ignore[attr-defined]
                                 phase=phase, lr=lr)
    return step


def one_line(err: BaseException) -> str:
    """An entry's error as one line: its type and the first line of its message, at most 300 characters."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _release(device: torch.device) -> None:
    """After a failed entry: return its cached CUDA memory, so that an out-of-memory entry leaves the next one
    room (after an error that broke the CUDA context this fails as well, and the next entry reports it)."""
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


def measure(entries: dict[str, Callable[[], None]], batch: int, steps: int, rounds: int,
            log: Callable[[str], None], device: torch.device = torch.device("cpu"),
            warmup: dict[str, int] | None = None) -> dict[str, dict]:
    """Step 4: warm-up (`warmup` steps by entry, default 1), then interleaved rounds; images/s per entry
    (median round, and every round). An entry that raises is taken out of `entries` (its model and memory
    freed), left out of the later rounds, and reported as {"error": one line}; the others keep their figures."""
    names = list(entries)
    failed: dict[str, str] = {}

    def fail(name: str, err: Exception) -> None:
        failed[name] = one_line(err)
        entries.pop(name)
        log(f"  {name} failed: {failed[name]}")
        _release(device)

    for name, step in list(entries.items()):
        t0 = time.perf_counter()
        try:
            for _ in range((warmup or {}).get(name, 1)):
                step()
            _sync(device)
        except Exception as err:   # noqa: BLE001 - reported as this entry's error; the others run
            fail(name, err)
            continue
        log(f"  warm-up {name}: {time.perf_counter() - t0:.1f} s")
    rates: dict[str, list[float]] = {name: [] for name in entries}
    for r in range(rounds):
        for name, step in list(entries.items()):
            try:
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                _sync(device)
            except Exception as err:   # noqa: BLE001
                fail(name, err)
                continue
            rates[name].append(batch * steps / (time.perf_counter() - t0))
        log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in entries) + " img/s")
    return {name: {"error": failed[name]} if name in failed else
            {"images_per_s": statistics.median(rates[name]), "rounds": rates[name]} for name in names}


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="largebatch bench train", description=__doc__.splitlines()[0])
    from largebatch.models import MODELS

    p.add_argument("--model", default="resnet50", help=f"architecture: one of {', '.join(MODELS)}")
    p.add_argument("--width", type=int, default=64, help="channels of the first stage")
    p.add_argument("--image-size", type=int, default=128, help="square input size in pixels")
    p.add_argument("--classes", type=int, default=1000, help="output classes")
    p.add_argument("--batch", type=int, default=32, help="images per step (one process)")
    p.add_argument("--configs", default="fp32,fp32-cl,bf16-cl",
                   help="comma-separated largebatch configurations PRECISION[-cl][-compile|-autotune][-graph]")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "lars", "lamb"), help="largebatch optimizer")
    p.add_argument("--steps", type=int, default=3, help="steps per entry per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: all cores)")
    p.add_argument("--peak-size", type=int, default=2048, help="matrix size of the peak matmul measurement")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: CUDA when available")
    p.add_argument("--peers", default="", help=f"comma-separated peer libraries ({', '.join(PEERS)}) whose model of "
                                               "the same name runs through the plain loop with each configuration")
    p.add_argument("--label-smoothing", type=float, default=0.0, help="largebatch's label smoothing (MLPerf: 0.1)")
    p.add_argument("--reference", default=None, help="NAME=IMAGES_PER_S: a published rate to compare the best with, "
                                                     "e.g. mlperf-v4.0-h200=7951 (MLPerf Training v4.0, per H200)")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    p.add_argument("--quiet", action="store_true", help="only the summary")
    args = p.parse_args(argv)
    reference = parse_reference(args.reference)
    if not 0 <= args.label_smoothing < 1:
        raise UserError(f"--label-smoothing is {args.label_smoothing}; give a number in [0, 1).")
    peers = [x for x in args.peers.split(",") if x]
    if set(peers) - set(PEERS):
        raise UserError(f"--peers has {sorted(set(peers) - set(PEERS))}; choose from {', '.join(PEERS)}.")
    check_numbers(*((f"--{n}", getattr(args, n), getattr(args, n) >= 1, "1 or more")
                    for n in ("batch", "steps", "rounds", "width")),
                  ("--classes", args.classes, args.classes >= 2, "2 or more (a classifier needs two classes)"),
                  ("--image-size", args.image_size, args.image_size >= 8, "8 or more pixels"),
                  ("--peak-size", args.peak_size, args.peak_size >= 16, "16 or more"))
    check_threads("--threads", args.threads)
    check_output_path("--json", args.json)
    from largebatch.models import build_model, check_model_name, count_flops

    check_model_name(args.model, "--model")
    specs = {name: parse_config(name) for name in args.configs.split(",") if name}
    if not specs:
        raise UserError("--configs is empty; give at least one configuration, e.g. fp32-cl.")
    log = (lambda m: None) if args.quiet else (lambda m: print(m, flush=True))

    from largebatch import dist as dist_mod

    device = dist_mod.pick_device(args.device)   # made current (dist.bind_device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")   # fp32 = TF32 on tensor cores, for every entry alike
    dist_mod.configure_backends(device, deterministic=False)   # cuDNN's benchmark, as `train` has it
    threads = dist_mod.set_threads(args.threads, 1)
    # 1. Peaks.
    sizes = {dtype: fitting_size(dtype, args.peak_size, 0.5) if device.type == "cpu" else args.peak_size
             for dtype in (torch.float32, torch.bfloat16)}
    peak_fp32 = matmul_peak_gflops(torch.float32, sizes[torch.float32], device=device)
    peak_bf16 = matmul_peak_gflops(torch.bfloat16, sizes[torch.bfloat16], device=device)
    peak = max(peak_fp32, peak_bf16)
    log(f"matmul peak ({threads} threads): fp32 {peak_fp32:.1f} GFLOP/s ({sizes[torch.float32]}^3), "
        f"bf16 {peak_bf16:.1f} GFLOP/s ({sizes[torch.bfloat16]}^3)")
    flops_per_image = 3 * count_flops(build_model(args.model, args.classes, in_channels=3, stem=stem(args),
                                                  width=args.width), (1, 3, args.image_size, args.image_size))
    # 2.-4. Entries, measured interleaved.
    with tempfile.TemporaryDirectory(prefix="largebatch-bench-train-") as tmp:
        entries: dict[str, Callable[[], None]] = {}
        built: dict[str, dict] = {}   # in the report's order; {"error": ...} for an entry that failed to build
        skipped: dict[str, str] = {}
        from largebatch.graph import WARMUP

        def build(name: str, make: Callable[[], Callable[[], None]]) -> None:
            try:
                entries[name] = make()
                built[name] = {}
            except Exception as err:   # noqa: BLE001 - this entry's error; the others are built and timed
                built[name] = {"error": one_line(err)}
                log(f"  {name} failed: {built[name]['error']}")
                _release(device)

        build("plain", lambda: plain_step_fn(args, args.classes, device))
        warmup = {}
        for name, spec in specs.items():
            build(name, functools.partial(largebatch_step_fn, args, spec, Path(tmp) / name, device))
            warmup[name] = WARMUP + 2 if spec["graph"] else 1
            for peer in peers:
                if f"{peer}:{peer_config(name)}" in built or peer in skipped:
                    continue
                model = peer_model(peer, args.model, args.classes)
                if isinstance(model, str):
                    skipped[peer] = model
                else:
                    build(f"{peer}:{peer_config(name)}", functools.partial(
                        plain_step_fn, args, args.classes, device, model, parse_config(peer_config(name))))
        for peer, why in skipped.items():
            log(f"  peer {peer} skipped: {why}")
        try:
            measured = measure(entries, args.batch, args.steps, args.rounds, log, device, warmup)
        finally:   # each trainer's CUDA graphs reset here, not by the garbage collector (largebatch/graph.py 7)
            for entry in entries.values():
                parts = getattr(entry, "parts", None)
                if parts is not None:
                    parts.trainer.close()
        results = {n: measured.get(n, r) for n, r in built.items()}
    # 5. Report (an entry that failed has its error and no figures).
    errors = {n: r["error"] for n, r in results.items() if "error" in r}
    plain = results.pop("plain").get("images_per_s")
    peer_results = {n: results.pop(n) for n in list(results) if ":" in n}
    for r in peer_results.values():
        if "error" not in r:
            r["mfu"] = r["images_per_s"] * flops_per_image / (peak * 1e9)
    ok = {n: r for n, r in results.items() if "error" not in r}
    best = max(ok, key=lambda n: ok[n]["images_per_s"]) if ok else None
    rate = ok[best]["images_per_s"] if best else None
    for r in ok.values():
        r["speedup"] = r["images_per_s"] / plain if plain else None
        r["mfu"] = r["images_per_s"] * flops_per_image / (peak * 1e9)

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    out = {
        "machine": machine(device), "device": str(device), "model": args.model, "width": args.width, "image_size": args.image_size,
        "batch": args.batch, "threads": threads, "optimizer": args.optimizer,
        "best_config": best, "images_per_s": rate, "plain_images_per_s": plain, "speedup": ratio(rate, plain),
        "train_gflops_per_image": flops_per_image / 1e9,
        "peak_matmul_gflops": peak, "peak_matmul_gflops_fp32": peak_fp32, "peak_matmul_gflops_bf16": peak_bf16,
        "peak_matmul_size_fp32": sizes[torch.float32], "peak_matmul_size_bf16": sizes[torch.bfloat16],
        "mfu": ratio(rate, peak * 1e9 / flops_per_image),
        "mfu_fp32_peak": ratio(rate, peak_fp32 * 1e9 / flops_per_image),
        "mfu_bf16_peak": ratio(rate, peak_bf16 * 1e9 / flops_per_image),
        "plain_mfu": ratio(plain, peak * 1e9 / flops_per_image),
        "configs": results,
        "peers": peer_results, "peers_skipped": skipped,
        # the best largebatch step over the faster peer with the same configuration's settings
        "vs_best_peer": {n: r["images_per_s"] / max(peer_results[f"{p}:{peer_config(n)}"]["images_per_s"]
                                                   for p in peers if f"{p}:{peer_config(n)}" in peer_results
                                                   and "error" not in peer_results[f"{p}:{peer_config(n)}"])
                         for n, r in ok.items() if any(f"{p}:{peer_config(n)}" in peer_results and "error" not in
                                                       peer_results[f"{p}:{peer_config(n)}"] for p in peers)},
        "label_smoothing": args.label_smoothing,
        "errors": errors,   # entry -> its error in one line; the entries without one have their figures
    }
    if reference is not None:
        out["reference"] = {"name": reference[0], "images_per_s": reference[1]}
        out["vs_reference"] = ratio(rate, reference[1])

    def figure(r: dict, speedup: bool = False) -> str:
        if "error" in r:
            return "failed"
        return f"{r['images_per_s']:.1f} img/s" + (f" ({r['speedup']:.2f}x)" if speedup and r["speedup"] else "")

    print(f"{args.model} @ {args.image_size} px, batch {args.batch}, {threads} threads: plain PyTorch "
          f"{'failed' if plain is None else f'{plain:.1f} img/s'}; "
          + "; ".join(f"{n} {figure(r, True)}" for n, r in results.items()))
    if rate is not None:
        print(f"best {best}: {rate:.1f} img/s"
              + (f", {rate / plain:.2f}x plain" if plain else "")
              + f"; MFU {out['mfu']:.1%} of the machine's "
              f"{peak:.0f} GFLOP/s matmul peak (fp32 peak {peak_fp32:.0f}: {out['mfu_fp32_peak']:.1%}, "
              + (f"bf16 peak {peak_bf16:.0f}: {out['mfu_bf16_peak']:.1%})" if peak_bf16 >= peak_fp32 else
                 f"bf16 peak {peak_bf16:.1f}: below fp32, so no bf16 units)"))
    if peer_results:
        print("peers (plain loop, same settings): " + "; ".join(f"{n} {figure(r)}" for n, r in peer_results.items()))
        if out["vs_best_peer"]:
            print("largebatch / faster peer: " + ", ".join(f"{n} {v:.2f}x" for n, v in out["vs_best_peer"].items()))
    if reference is not None and out["vs_reference"] is not None:
        print(f"best / {reference[0]} ({reference[1]:.0f} img/s): {out['vs_reference']:.2f}x")
    for name, error in errors.items():
        print(f"failed {name}: {error}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(args.json, (json.dumps(out, indent=2)).encode())   # whole or absent
    if errors:
        print(f"largebatch bench train: {len(errors)} of {1 + len(results) + len(peer_results)} entries failed "
              f"({', '.join(errors)}); the others' figures are above" + (f" and in {args.json}" if args.json else "")
              + ".", file=sys.stderr, flush=True)
        return 1
    return 0
