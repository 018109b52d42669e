"""Memory per device, and the micro-batch that fits it (`batch.micro_batch: auto`).

1. State: bytes that do not grow with the batch: fp32 parameters and their gradients, the optimizer's state
   (momentum: 1 copy of the weights; LAMB: 2), the EMA's copy of weights and buffers, the buffers that keep
   shared scalars on the multi-tensor path on CUDA (largebatch.optim.skip.Spread: 1 copy for LARS, LAMB and the
   EMA each), and under bf16/fp16 autocast the half-precision copies of the weights that the forward keeps.
2. Per image: the bytes autograd saves for the backward pass, counted with saved-tensor hooks on the model
   itself, built on the meta device (shapes only, nothing allocated or computed), at the run's largest
   resolution, in the run's precision (the model cast to bf16/fp16 stands in for autocast), as the difference
   between batches of 4 and 2 (what is saved once, such as weight copies, cancels); plus the backward's working
   set (the gradients of the largest saved activation's layer output and input, alive at once), the input
   batch (uint8) and its normalised fp32 copy. ResNet-50 at 224 px in fp32 on the CPU: 91.6 MiB per image
   estimated, 94.1 MiB measured once (peak RSS from 4 to 12 images); tests/unit/test_memory.py checks 128 px.
3. Margin: 10% of the device's memory and 1 GiB on CUDA (the CUDA context, cuDNN's workspace, the allocator's
   fragmentation); 20% on the CPU (the framework itself and the loader's buffers). Besides, on CUDA, what
   other parts hold on the GPU (`Estimate.other_bytes`, named in the description): NCCL's buffers where there
   are 2+ workers (`NCCL_BYTES`), and with `data.decode: gpu` the decoded-image cache (`data.gpu_cache_gb`, one
   budget for the run's sources together) and the decoder's output of one step's batch and the next
   (`DECODED_BYTES_PER_IMAGE` per image).
4. The device's memory: in a run, the GPU's free memory when the run is built (torch.cuda.mem_get_info on the
   rank's own device: what other processes hold is not ours to use); in a dry run on a GPU host, the same
   figure read in a short child process (`gpu_memory`: the dry run's own process creates no CUDA context); the
   CPU's available memory (/proc/meminfo) divided by the local workers; or what the user gives
   (`train.device_memory_gb`, e.g. for a dry run that plans an 80 GB GPU from a laptop).
5. `batch.micro_batch: auto`: the largest micro-batch whose need (1 + 2 x micro-batch + 3) fits 4, never more
   than the per-worker batch; the plan then splits each worker's batch into the fewest equal micro-batches of
   at most that many images (gradient accumulation), so the global batch and the lr stay as asked. BatchNorm
   then normalises over each micro-batch (its batch is the micro-batch).
6. When the estimate is wrong: on one worker, an out-of-memory error in the first `OOM_RETRY_STEPS` steps of a
   session or of a batch phase halves the forward batch and retries the step, saying so in one line (the trainer:
   `TrainStep.forward_cap`; as Composer's automatic micro-batching does); the global batch never changes. Later,
   or across workers (a retry on one rank alone would desynchronise DDP), it is one sentence naming
   batch.micro_batch.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace

import torch

from largebatch.errors import UserError

GIB = 2 ** 30
OOM_RETRY_STEPS = 3   # step 6
MARGIN = {"cuda": (0.10, 1 * GIB), "cpu": (0.20, 0)}   # fraction of the device, plus bytes
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
# NCCL's buffers per process with 2+ workers: NCCL_BUFFSIZE (4 MiB by default) per channel (up to 32 on an H100
# node), for sending and receiving, for the ring and the tree algorithm (NCCL's environment-variable docs).
NCCL_BYTES = 4 * 2**20 * 32 * 2 * 2
# A decoded JPEG of ImageNet's mean size (469 x 387 pixels, RGB uint8), as data.decode gpu's decoder returns it
# (whole images where a cache is kept; windows, smaller, otherwise): one step's batch and the next one in flight.
DECODED_BYTES_PER_IMAGE = 469 * 387 * 3
STATE_COPIES = {"sgd": 1, "lars": 1, "lamb": 2}        # optimizer state in copies of the fp32 weights
SPREAD_COPIES = {"sgd": 0, "lars": 1, "lamb": 1}       # Spread buffers on CUDA


@dataclass(frozen=True)
class Estimate:
    device_bytes: int      # step 4
    device_source: str
    state_bytes: int       # step 1
    per_image_bytes: int   # step 2
    margin_bytes: int      # step 3
    other_bytes: int = 0   # step 3: what other parts hold on the device (NCCL, the decoded-image cache, ...)
    other_source: str = ""

    def need(self, micro_batch: int) -> int:
        return self.state_bytes + micro_batch * self.per_image_bytes + self.margin_bytes + self.other_bytes

    def largest(self) -> int:
        """The most images of one forward pass that fit (0: not even the model's state fits)."""
        room = self.device_bytes - self.state_bytes - self.margin_bytes - self.other_bytes
        return max(room // max(self.per_image_bytes, 1), 0)

    def describe(self, micro_batch: int) -> str:
        other = f", besides the model {self.other_bytes / GIB:.1f} GiB ({self.other_source})" if self.other_bytes else ""
        return (f"{micro_batch} images a forward pass need {self.need(micro_batch) / GIB:.1f} GiB of "
                f"{self.device_bytes / GIB:.1f} GiB ({self.device_source}): state {self.state_bytes / GIB:.2f} GiB, "
                f"{self.per_image_bytes / 2**20:.1f} MiB per image, margin {self.margin_bytes / GIB:.1f} GiB{other}")

    def with_other(self, parts: list[tuple[str, int]]) -> Estimate:
        """This estimate with `parts` ((what, bytes)) held on the device besides the model."""
        parts = [(what, n) for what, n in parts if n > 0]
        if not parts:
            return self
        return replace(self, other_bytes=self.other_bytes + sum(n for _, n in parts),
                       other_source=", ".join([*filter(None, [self.other_source]),
                                               *(f"{what} {n / GIB:.1f} GiB" for what, n in parts)]))


def saved_bytes_per_image(net: torch.nn.Module, in_channels: int, size: int, precision: str) -> tuple[int, int]:
    """Step 2 on a meta-device `net`: (bytes saved per image, bytes saved once per forward pass)."""
    dtype = HALF.get(precision, torch.float32)
    net = net.to(dtype=dtype)
    net.train()

    def saved(batch: int) -> tuple[int, int]:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
            return t

        x = torch.zeros(batch, in_channels, size, size, device="meta", dtype=dtype)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            net(x)
        return sum(seen.values()), max(seen.values(), default=0)

    (two, _), (four, largest) = saved(2), saved(4)   # 2 and 4, not 1: BatchNorm refuses one value per channel
    per_image = max(four - two, 0) // 2
    # the backward's working set: the gradients of the largest layer's output and input, alive at once
    working = largest // 2   # 2 x the largest saved tensor of one image (of a batch of 4: largest / 4)
    return per_image + working + in_channels * size * size * (1 + 4), max(two - 2 * per_image, 0)


def meta_net(cfg, info) -> torch.nn.Module:
    """The run's network on the meta device (no memory, no compute)."""
    from largebatch.models import build_model

    stem = cfg.model.stem
    if stem == "auto":
        stem = "small" if info.image_size <= 64 else "imagenet"
    with torch.device("meta"):
        return build_model(cfg.model.name, num_classes=info.num_classes, in_channels=info.in_channels, stem=stem,
                           zero_init_residual=cfg.model.zero_init_residual, width=cfg.model.width)


def device_memory(device_type: str, device: torch.device | None, local_workers: int, given_gib: float | None
                  ) -> tuple[int, str]:
    """Step 4: (bytes one worker may use, where that figure comes from). `device`: the rank's own CUDA device in a
    run (current, torchrun's layout: one worker per GPU); None in a dry run."""
    if given_gib is not None:
        return int(given_gib * GIB), f"train.device_memory_gb {given_gib:g}"
    if device_type == "cuda" and device is not None and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)   # what other processes hold is not ours
        name = torch.cuda.get_device_name(device)
        return min(free, total), f"{name}: {free / GIB:.1f} of {total / GIB:.1f} GiB free, torch.cuda.mem_get_info"
    if device_type == "cuda":
        found = gpu_memory()
        if found:
            name, free, total = min(found, key=lambda g: g[1])
            return free, (f"{name}: {free / GIB:.1f} of {total / GIB:.1f} GiB free (the least of {len(found)} "
                          "GPUs here), torch.cuda.mem_get_info in a child process")
        available = _available_cpu_bytes()
        return available // max(local_workers, 1), ("no GPU visible here, so the CPU's available memory / "
                                                    f"{max(local_workers, 1)}: set train.device_memory_gb to plan "
                                                    "a GPU")
    available = _available_cpu_bytes()
    return available // max(local_workers, 1), f"the CPU's available memory / {max(local_workers, 1)} local workers"


_PROBE = ("import json, torch\n"
          "print(json.dumps([[torch.cuda.get_device_name(i), *torch.cuda.mem_get_info(i)] "
          "for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []))")


def gpu_memory(timeout_s: float = 120.0) -> list[tuple[str, int, int]]:
    """(name, free bytes, total bytes) of each visible GPU, read in a child process, so that the caller (a dry run,
    a launcher that starts workers later) creates no CUDA context of its own: a process that has initialised CUDA
    cannot fork workers that use it, and a context holds about half a GiB of the GPU. [] where there is none or
    the child fails."""
    import json
    import subprocess

    if not torch.cuda.is_available():   # NVML/driver query only: no context
        return []
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s)
        return [(str(n), int(f), int(t)) for n, f, t in json.loads(out.stdout.strip().splitlines()[-1])]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return []


def others_on_device(cfg, device_type: str, world_size: int, per_worker_batch: int) -> list[tuple[str, int]]:
    """Step 3's other parts on a CUDA device for a run of `cfg`: NCCL's buffers (2+ workers), data.decode gpu's
    cache (data.gpu_cache_gb, one budget for the run) and its decoded images of two steps."""
    if device_type != "cuda":
        return []
    parts = [("NCCL buffers", NCCL_BYTES if world_size > 1 else 0)]
    if getattr(cfg.data, "decode", "cpu") == "gpu":
        parts += [("data.gpu_cache_gb", int(cfg.data.gpu_cache_gb * GIB)),
                  ("decoded images", 2 * per_worker_batch * DECODED_BYTES_PER_IMAGE)]
    return parts


def _available_cpu_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# A network's (parameters, floating-point buffer values, bytes saved per image), by what builds it and the input
# it is measured at: a study's dry run estimates each of its groups, most with one network; each is built and run
# on the meta device once per process.
_NET_FIGURES: dict[tuple, tuple[int, int, int]] = {}


def net_figures(net: torch.nn.Module, in_channels: int, image_size: int, precision: str) -> tuple[int, int, int]:
    """(trainable parameters, floating-point buffer values, bytes saved per image: step 2) of a meta-device net."""
    params = sum(p.numel() for p in net.parameters() if p.requires_grad)
    buffers = sum(b.numel() for b in net.buffers() if b.is_floating_point())
    per_image, _ = saved_bytes_per_image(net, in_channels, image_size, precision)
    return params, buffers, per_image


def estimate(cfg, info, device_type: str, device_bytes: int, source: str) -> Estimate:
    """Steps 1-3 for the run `cfg` on a device of `device_bytes`."""
    size = max([cfg.data.image_size, *(p.image_size for p in cfg.data.resolution_phases)])
    key = (repr(cfg.model), info.num_classes, info.in_channels, info.image_size, size, cfg.train.precision)
    if key not in _NET_FIGURES:
        _NET_FIGURES[key] = net_figures(meta_net(cfg, info), info.in_channels, size, cfg.train.precision)
    return _estimate(_NET_FIGURES[key], precision=cfg.train.precision, optimizer=cfg.optim.name,
                     momentum=cfg.optim.momentum, ema=bool(cfg.train.ema), device_type=device_type,
                     device_bytes=device_bytes, source=source)


def estimate_net(net: torch.nn.Module, *, in_channels: int, image_size: int, precision: str, optimizer: str,
                 momentum: float, ema: bool, device_type: str, device_bytes: int, source: str) -> Estimate:
    """Steps 1-3 for a meta-device `net` (`estimate`; `largebatch plan` gives its own values)."""
    return _estimate(net_figures(net, in_channels, image_size, precision), precision=precision, optimizer=optimizer,
                     momentum=momentum, ema=ema, device_type=device_type, device_bytes=device_bytes, source=source)


def _estimate(figures: tuple[int, int, int], *, precision: str, optimizer: str, momentum: float, ema: bool,
              device_type: str, device_bytes: int, source: str) -> Estimate:
    params, buffers, per_image = figures
    copies = 2 + (STATE_COPIES[optimizer] if optimizer != "sgd" or momentum > 0 else 0)
    state = copies * params * 4
    if ema:
        state += (params + buffers) * 4
    if device_type == "cuda":
        state += (SPREAD_COPIES[optimizer] + (1 if ema else 0)) * params * 4
    if precision in HALF:
        state += params * 2
    fraction, fixed = MARGIN.get(device_type, MARGIN["cpu"])
    return Estimate(device_bytes, source, state, per_image, int(device_bytes * fraction) + fixed)


def fit_micro_batch(est: Estimate, per_worker: int, what: str = "the model", fix: str = "a smaller model") -> int:
    """Step 5: the micro-batch cap for a per-worker batch; a state that does not fit at all is one sentence naming
    `what` (the model and its width) and `fix`."""
    largest = est.largest()
    if largest < 1:
        other = f" and {est.other_source}" if est.other_bytes else ""
        raise UserError(f"{what} does not fit in memory: its state alone ({est.state_bytes / GIB:,.1f} GiB with a "
                        f"{est.margin_bytes / GIB:.1f} GiB margin{other}) is more than the {est.device_bytes / GIB:.1f} GiB "
                        f"of {est.device_source}; give {fix}, a device with more memory, or train.device_memory_gb "
                        "if that figure is wrong.")
    return min(largest, per_worker)


def stand_in_info(cfg):
    """The data's shape for a dry run that reads no data (data.train_size given): channels and classes by kind."""
    from largebatch.data.info import DatasetInfo

    data = cfg.data
    channels = 1 if data.dataset == "fashion_mnist" else 3
    classes = data.num_classes if data.dataset in ("synthetic", "webdataset") else (
        10 if data.dataset == "fashion_mnist" else 1000)
    return DatasetInfo(classes, channels, data.image_size, (0.5,) * channels, (0.25,) * channels, 0, 0, "stand-in")


def device_type_for(cfg) -> str:
    """The kind of device a run of `cfg` trains on: train.device, and with auto CUDA where it is, or where a
    memory per device is given (a plan for GPUs made on another machine)."""
    if cfg.train.device != "auto":
        return cfg.train.device
    return "cuda" if torch.cuda.is_available() or cfg.train.device_memory_gb is not None else "cpu"


def resolve(cfg, info, *, world_size: int, local_workers: int, device_type: str,
            device: torch.device | None = None, given: tuple[int, str] | None = None
            ) -> tuple[int | None, Estimate | None]:
    """Step 5 for a run: (the micro-batch cap that `batch.micro_batch: auto` resolves to, or None where the
    recipe decides the split itself, the estimate). The cap is for the largest per-worker batch of any phase.
    `given`: the device's memory in bytes and where that figure comes from (`largebatch plan`'s catalog), in place
    of step 4."""
    device_bytes, source = given or device_memory(device_type, device, local_workers, cfg.train.device_memory_gb)
    batches = [p.global_batch for p in cfg.batch.phases] or [cfg.batch.global_batch]
    per_worker = max(batches) // max(world_size, 1)
    try:
        est = estimate(cfg, info, device_type, device_bytes, source).with_other(
            others_on_device(cfg, device_type, world_size, per_worker))
    except Exception as err:   # noqa: BLE001 - a model that does not run on the meta device: no estimate
        if cfg.batch.micro_batch == "auto" and cfg.batch.accumulation is None and os.environ.get("RANK", "0") == "0":
            print(f"largebatch: batch.micro_batch auto cannot estimate this model's memory on the meta device "
                  f"({type(err).__name__}); each worker's batch runs in one forward pass unless batch.micro_batch "
                  "is set.", file=sys.stderr, flush=True)
        return None, None
    if cfg.batch.micro_batch != "auto" or cfg.batch.accumulation is not None:
        return None, est
    return fit_micro_batch(est, per_worker, f"model {cfg.model.name} at width "
                           f"{cfg.model.width}", "a smaller model.width"), est
