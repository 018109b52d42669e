"""The exponential moving average of a model's weights and buffers (the `train.ema` option), updated on the
device with no host sync, and skipped on the device with the step it follows.

The average is torch's `AveragedModel` (its state_dict is what checkpoints hold) with the EMA rule of
`get_ema_multi_avg_fn(decay)`; `update_ema` computes exactly its `update_parameters`, but
1. its count `n_averaged` lives on the model's device, so that the first update (a copy: n = 0) is chosen
   by `torch.where` instead of a host branch;
2. with `ok` (1.0 or 0.0 on the device, the step's verdict) an update with ok = 0 leaves every tensor and
   the count as they were: float tensors move by lerp(ema, model, w) with w = ok * (1 at n = 0, else
   1 - decay); integer buffers (BN's batch count) take torch's rounding of ema * decay + model * (1 - decay).
3. Kernels: one multi-tensor lerp per dtype (w spread into buffers on CUDA, largebatch.optim.skip.Spread), and
   the integer buffers of each dtype and shape stacked into one tensor, updated and copied back with one
   multi-tensor copy, instead of a few kernels per buffer.
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from largebatch.optim.skip import Spread


class EMA(AveragedModel):
    """torch's AveragedModel with the EMA rule of `decay`, its count on the model's device."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.decay = decay
        device = next(itertools.chain(model.parameters(), model.buffers())).device
        self.n_averaged = self.n_averaged.to(device)   # reassigning a registered buffer keeps it a buffer
        self.spread = Spread()   # the update's weight as a multi-tensor operand (buffers on CUDA)


def build_ema(model: nn.Module, decay: float | None) -> EMA | None:
    """The exponential moving average of `model`'s weights and buffers (None without a decay)."""
    return EMA(model, decay) if decay else None


@torch.no_grad()
def update_ema(ema: EMA, model: nn.Module, ok: Optional[Tensor] = None) -> None:
    """Steps 1-2: `ema.update_parameters(model)` on the device, skipped where `ok` is 0."""
    n = ema.n_averaged
    first = n == 0
    weight = torch.where(first, torch.ones((), dtype=torch.float64, device=n.device),
                         torch.full((), 1.0 - ema.decay, dtype=torch.float64, device=n.device))
    if ok is not None:
        weight = weight * ok
    floats: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
    ints: dict[tuple, tuple[list[Tensor], list[Tensor]]] = {}
    for mine, theirs in zip(itertools.chain(ema.module.parameters(), ema.module.buffers()),
                            itertools.chain(model.parameters(), model.buffers())):
        mine, theirs = mine.detach(), theirs.detach()
        group = floats.setdefault(mine.dtype, ([], [])) if mine.is_floating_point() else \
            ints.setdefault((mine.dtype, tuple(mine.shape)), ([], []))
        group[0].append(mine)
        group[1].append(theirs)
    for (dtype, _), (dst, src) in ints.items():
        mine_t, theirs_t = torch.stack(dst), torch.stack(src)
        mixed = (mine_t * ema.decay + theirs_t * (1.0 - ema.decay)).to(dtype)
        new = torch.where(first, theirs_t, mixed)
        torch._foreach_copy_(dst, list((new if ok is None else torch.where(ok > 0, new, mine_t)).unbind(0)))
    for dtype, (dst, src) in floats.items():
        torch._foreach_lerp_(dst, src, ema.spread(dtype, dst, weight))
    n += 1 if ok is None else ok.to(n.dtype)
