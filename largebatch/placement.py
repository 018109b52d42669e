"""Where a batch or a model lives and in what form: device, memory format, autocast precision, resolution.

One rule for every part that moves batches (the trainer, evaluation, the Collapsed Ensemble's snapshot
evaluation), kept apart from the trainer so that those parts do not import each other.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def autocast(device: torch.device, precision: str):
    """The autocast context of `precision` (fp32: none; bf16; fp16, with the trainer's GradScaler)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def to_model_layout(x: torch.Tensor, device: torch.device, channels_last: bool) -> torch.Tensor:
    """Move a batch to the device in the model's memory format.

    JPEG batches arrive as NCHW views of NHWC memory; mixing formats picks slower (and on CPU, for
    very narrow convs under DDP, crashing) kernels. A no-op when the layout already matches.
    """
    x = x.to(device, non_blocking=True)
    if x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return x


def resize_batch(x: torch.Tensor, size: int, channels_last: bool) -> torch.Tensor:
    """Progressive resizing: a batch (uint8 or float) resized to size x size on its device, bilinear
    with antialiasing when shrinking; the result is float in uint8/255 units, which the model's
    Normalize layer takes as is."""
    x = x.float().div_(255.0) if x.dtype == torch.uint8 else x
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False,
                      antialias=size < x.shape[-1])
    return x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def use_channels_last(choice: str, device: torch.device, precision: str) -> bool:
    if choice == "auto":
        return device.type == "cuda" or precision == "bf16"
    return choice == "on"


# torch 2.13's oneDNN corrupts the heap computing the weight gradient of a 1x1 convolution with stride 2 and fewer
# than 8 input channels in channels-last memory on CPU (seen on an AVX2-only EPYC, 1 intra-op thread: a segfault
# or 'munmap_chunk(): invalid pointer' in mkldnn_convolution_backward_weights at the first backward; 8 channels,
# stride 1 and NCHW memory are fine; CUDA runs convolutions in cuDNN, not here). A ResNet below width 8 has one
# (its layer2 shortcut).
NARROW_CHANNELS = 8


def cpu_channels_last_hazard(model: torch.nn.Module) -> str | None:
    """The first convolution that channels-last memory would crash on CPU (above), as 'NAME (C input channels)';
    None when there is none."""
    for name, m in model.named_modules():
        if (isinstance(m, torch.nn.Conv2d) and m.kernel_size == (1, 1) and max(m.stride) > 1
                and m.in_channels < NARROW_CHANNELS):
            return f"{name} ({m.in_channels} input channels)"
    return None


def prefetch(steps, device: torch.device, channels_last: bool):
    """The training loop's steps `(phase, micro-batches, wait)` with the micro-batches already on `device` in
    the model's layout. On CUDA each step's host-to-device copies run on a side stream one step ahead: when
    step k is handed out, step k + 1's batches are fetched (a GPU decoder's kernels included) and their copy is
    queued on the side stream behind nothing but the previous copies, so it overlaps step k's kernels; the compute stream waits for step k's copy alone (an
    event), and the tensors are recorded on it so the allocator keeps them until the step has used them. The
    batches should be pinned (the loaders pin them on CUDA) for the copy to be asynchronous. Elsewhere a
    pass-through: the step moves its batches itself."""
    if device.type != "cuda":
        yield from steps
        return
    side = torch.cuda.Stream(device)

    def issue(item):
        phase, micros, wait = item
        with torch.cuda.stream(side):
            moved = [(to_model_layout(x, device, channels_last), y.to(device, non_blocking=True)) for x, y in micros]
            ready = torch.cuda.Event()
            ready.record()
        return phase, moved, wait, ready

    it = iter(steps)

    def fetch():   # a loader that decodes on the GPU (data.decode gpu) queues its kernels on the side stream too
        with torch.cuda.stream(side):
            return next(it, None)

    pending = fetch()
    ahead = issue(pending) if pending is not None else None
    while ahead is not None:
        following = fetch()
        current, ahead = ahead, issue(following) if following is not None else None
        phase, moved, wait, ready = current
        compute = torch.cuda.current_stream(device)
        compute.wait_event(ready)
        for x, y in moved:
            x.record_stream(compute)
            y.record_stream(compute)
        yield phase, moved, wait
