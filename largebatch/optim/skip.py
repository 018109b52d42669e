"""Skipping an optimizer step on the device: the protocol LARS, LAMB and fused SGD share, so that a step
with a non-finite gradient is dropped without the host ever reading the verdict (no host sync, and a step
that a CUDA graph can hold).

1. The verdict is `optimizer.found_inf`, a 0-dim float tensor on the parameters' device, non-zero when the
   step must be skipped: set by `torch.amp.GradScaler.step` (fp16, for optimizers with
   `_step_supports_amp_scaling`) or by the training step itself (`step.TrainStep`), and deleted after the
   step. Without it the step is applied (the plain `optimizer.step()` of any caller).
2. A skipped step leaves the parameters and every state tensor bit for bit as they were; the update
   is computed with its scales multiplied by ok = (found_inf == 0) and its momentum factor replaced by 1.
3. The gradients of a skipped step may hold NaN or inf, and 0 * NaN is NaN: `zero_bad_grads_` clears them
   with one integer multiply over their bits (0 bits are +0.0), a no-op on a finite step.
"""
from __future__ import annotations

from typing import Hashable, Optional, Union

import torch
from torch import Tensor

_INT_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def device_scalar(value: Union[float, Tensor], device: torch.device) -> Tensor:
    """A group's lr (a float, or a 0-dim tensor such as a CUDA graph's static lr) as a float64 0-dim tensor on
    `device`; no host sync (a float is a fill kernel's argument, not a copy from host memory)."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float64, non_blocking=True)
    return torch.full((), value, dtype=torch.float64, device=device)


def ok_flag(optimizer: torch.optim.Optimizer, device: torch.device) -> Optional[Tensor]:
    """Step 1: 1.0 where the step applies and 0.0 where it is skipped (float64, on `device`); None without a
    verdict (every step applies)."""
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is None:
        return None
    return (found_inf.to(device=device, non_blocking=True) == 0).to(torch.float64)


def zero_bad_grads_(grads: list[Tensor], ok: Optional[Tensor]) -> None:
    """Step 3: every gradient becomes +0.0 when ok is 0 (bitwise, so NaN and inf go too); unchanged when 1."""
    if ok is None or not grads:
        return
    by_size: dict[int, list[Tensor]] = {}
    for g in grads:
        by_size.setdefault(g.element_size(), []).append(g)
    for size, gs in by_size.items():
        dtype = _INT_OF[size]
        torch._foreach_mul_([g.view(dtype) for g in gs], ok.to(dtype))


# Devices where a device scalar is spread into dense buffers for multi-tensor ops (`Spread`): on CUDA a kernel
# launch costs more than a pass over the buffer; on the CPU there is no multi-tensor kernel to keep.
DENSE_DEVICES = {"cuda"}


class Spread:
    """A 0-dim device scalar as the operand of a multi-tensor (`torch._foreach_*`) op without leaving torch's
    multi-tensor kernel. That kernel (the "fast route") needs every list to hold tensors of equal sizes and
    strides index by index; a list of 0-dim tensors sends the op to one kernel per tensor (torch has no form
    taking one device scalar for lerp or addcmul; only `_foreach_mul_`, `_foreach_add_` and `_foreach_div_`
    take one). So on `DENSE_DEVICES` the scalar is written into buffers shaped like the list (two multi-tensor
    kernels), kept from step to step (made at the first step, before a CUDA graph's capture); elsewhere the
    list of 0-dim tensors is returned. Both give the same numbers: every element sees the same scalar."""

    def __init__(self) -> None:
        self.buffers: dict[Hashable, list[Tensor]] = {}

    def __call__(self, key: Hashable, like: list[Tensor], value: Tensor) -> list[Tensor]:
        value = value.to(like[0].dtype)
        if like[0].device.type not in DENSE_DEVICES:
            return [value] * len(like)
        bufs = self.buffers.get(key)
        if bufs is None or len(bufs) != len(like):
            bufs = self.buffers[key] = [torch.empty_like(t) for t in like]
        torch._foreach_zero_(bufs)
        torch._foreach_add_(bufs, value)
        return bufs
