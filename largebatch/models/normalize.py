"""Input normalisation as the model's first layer, so that data stays uint8 until the device.

Shipping uint8 images from the loader to the device moves 4x fewer bytes than float32; the cast
then runs on the device, inside the model's first step:

1. uint8 input: cast to float32 (keeping the memory format, e.g. channels_last).
   Floating input keeps its dtype and is taken to be in [0, 1] already (uint8 / 255 units).
2. y = (x / 255 - mean) / std for uint8, y = (x - mean) / std for floats, computed as one
   multiply and one add per element with per-channel scale and shift precomputed at construction.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn


class Normalize(nn.Module):
    """(x - mean) / std per channel for NCHW uint8 (scaled by 1/255 first) or float input.

    `mean` and `std` are per-channel values in [0, 1] units (e.g. ImageNet's
    (0.485, 0.456, 0.406) and (0.229, 0.224, 0.225)). The output keeps the input's memory
    format (channels_last stays channels_last). The constants are non-persistent buffers: they
    follow `.to(device)` but are not written to checkpoints.
    """

    scale: Tensor      # the buffers registered in __init__
    scale_u8: Tensor
    shift: Tensor

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        mean_t = torch.as_tensor(list(mean), dtype=torch.float32).reshape(1, -1, 1, 1)
        std_t = torch.as_tensor(list(std), dtype=torch.float32).reshape(1, -1, 1, 1)
        if mean_t.numel() != std_t.numel() or mean_t.numel() == 0:
            raise ValueError(f"mean and std need one value per channel, got {list(mean)} and {list(std)}")
        if bool((std_t <= 0).any()):
            raise ValueError(f"std must be positive, got {list(std)}")
        # 2. y = x * scale + shift with scale = 1 / std (/ 255 for uint8), shift = -mean / std.
        self.register_buffer("scale", 1.0 / std_t, persistent=False)
        self.register_buffer("scale_u8", 1.0 / (255.0 * std_t), persistent=False)
        self.register_buffer("shift", -mean_t / std_t, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.shape[1] != self.shift.shape[1]:
            raise ValueError(f"Normalize expects NCHW input with {self.shift.shape[1]} channels, got shape {tuple(x.shape)}")
        if x.dtype == torch.uint8:
            # 1. The cast keeps the memory format; the in-place ops below then keep it too.
            y = x.to(torch.float32)
            return y.mul_(self.scale_u8).add_(self.shift)
        if not x.is_floating_point():
            raise TypeError(f"Normalize expects uint8 or floating input, got {x.dtype}")
        return x.mul(self.scale.to(x.dtype)).add_(self.shift.to(x.dtype))

    def extra_repr(self) -> str:
        mean = (-self.shift / self.scale).flatten().tolist()
        std = (1.0 / self.scale).flatten().tolist()
        return f"mean={[round(m, 4) for m in mean]}, std={[round(s, 4) for s in std]}"
