"""Forward cost of a model: multiply-accumulates (MACs) and FLOPs of its convolutions and matrix products.

Convention. One MAC is one multiply plus one add; FLOPs = 2 x MACs, the unit of a device's peak
FLOP/s (an FMA counts as 2 FLOPs), so MFU = 3 * count_flops * images/s / peak FLOP/s is consistent.
The "4.1 GFLOPs" usually quoted for ResNet-50 at 224 px (He et al.) is a MAC count:
`count_macs(resnet50)` = 4.09e9 and `count_flops(resnet50)` = 8.18e9 per image.

Method (for any nn.Module: largebatch's own, timm's, torchvision's or a factory's):

1. Replace every parameter and buffer by a tensor on the meta device (shapes only, no memory,
   no arithmetic) and run one forward pass of `input_shape` with `torch.func.functional_call`;
   the model's own weights are not touched or copied.
2. torch's `FlopCounterMode` counts the FLOPs of every operator the pass dispatches whose cost it
   knows: convolutions (2 x output elements x in_channels/groups x kernel area), matrix products
   (linear layers and the attention products of a transformer, `bmm`, scaled-dot-product attention).
   BN, activations, pooling, soft-max and the residual additions (under 1% of a ResNet's cost) are
   not counted. For largebatch's models this is exactly the count of the conv and linear layers
   (ResNet-50 at 224 px: 8,178,368,512 FLOPs either way).
3. The model runs in eval mode for the count (BN on batch 1 in training mode is an error) and
   gets its previous train/eval flags back afterwards.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode


def count_macs(model: nn.Module, input_shape: Sequence[int] = (1, 3, 224, 224)) -> int:
    """Multiply-accumulates of one forward pass of a batch of `input_shape` (count_flops / 2)."""
    return count_flops(model, input_shape) // 2


def count_flops(model: nn.Module, input_shape: Sequence[int] = (1, 3, 224, 224)) -> int:
    """Forward FLOPs (= 2 x MACs, see the module docstring) of a batch of `input_shape` (steps 1-3)."""
    # 3. Eval mode for the count; remember the flags.
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        # 1. Meta tensors in place of the weights.
        tensors = {name: torch.empty_like(t, device="meta")
                   for name, t in (*model.named_parameters(), *model.named_buffers())}
        x = torch.empty(tuple(input_shape), device="meta")
        # 2. Every operator's FLOPs, counted by torch.
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            functional_call(model, tensors, (x,))
    finally:
        for m, mode in modes.items():
            m.training = mode
    return int(counter.get_total_flops())
