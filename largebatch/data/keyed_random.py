"""Counter-based random numbers keyed by (seed, epoch, image index, stream).

Augmentation must give the same pixels for an image whatever process decodes it
(any number of loader workers, any world size, a resumed run). A stateful generator
cannot promise that; a hash of the key can (Salmon et al., "Parallel random numbers:
as easy as 1, 2, 3", SC 2011, counter-based RNGs). The steps:

1. Fold the key parts into 32 bits with a strong integer mixer (Wellons' ``lowbias32``:
   xor-shift, multiply, xor-shift, multiply, xor-shift), one round per part.
2. A ``stream`` number separates independent draws for the same image (crop x, crop y,
   flip, ...).
3. ``uniform`` maps the 32-bit hash to [0, 1) with 2**-32 resolution.

The same code runs on Python ints (one image, in a loader worker) and on int64 torch
tensors (a whole batch at once, vectorised); products that overflow int64 wrap, and
only their low 32 bits are kept, so both give identical numbers.
"""
from __future__ import annotations

from typing import TypeVar, overload

import torch

T = TypeVar("T", int, torch.Tensor)
_MASK = 0xFFFFFFFF


def _mix(x: T) -> T:
    """Step 1: lowbias32 on the low 32 bits (x must be non-negative)."""
    x = x & _MASK
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK
    x = x ^ (x >> 16)
    return x


def hash32(seed: int, epoch: int, index: T, stream: int) -> T:
    """Steps 1-2: a 32-bit hash of the key; `index` may be an int or an int64 tensor."""
    h = _mix((int(seed) & _MASK) ^ 0x9E3779B9)
    h = _mix(h ^ (int(seed) >> 32 & _MASK))
    h = _mix(h ^ (int(epoch) & _MASK))
    h = _mix(h ^ (int(stream) & _MASK))
    return _mix((index & _MASK) ^ h)


@overload
def uniform(seed: int, epoch: int, index: int, stream: int) -> float: ...
@overload
def uniform(seed: int, epoch: int, index: torch.Tensor, stream: int) -> torch.Tensor: ...
def uniform(seed: int, epoch: int, index: T, stream: int) -> float | torch.Tensor:
    """Step 3: a float in [0, 1) (a Python float, or a float64 tensor)."""
    h = hash32(seed, epoch, index, stream)
    if isinstance(h, torch.Tensor):
        return h.to(torch.float64) * (1.0 / 2**32)
    return h * (1.0 / 2**32)
