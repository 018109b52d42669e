"""Forward cost of a model: multiply-accumulates (MACs) and FLOPs of its conv and linear layers.

Convention. One MAC is one multiply plus one add; FLOPs = 2 x MACs, the unit of a device's peak
FLOP/s (an FMA counts as 2 FLOPs), so MFU = 3 * count_flops * images/s / peak FLOP/s is consistent.
The "4.1 GFLOPs" usually quoted for ResNet-50 at 224 px (He et al.; FACTS.md) is a MAC count:
`count_macs(resnet50)` = 4.09e9 and `count_flops(resnet50)` = 8.18e9 per image.

Method:

1. Replace every parameter and buffer by a tensor on the meta device (shapes only, no memory,
   no arithmetic) and run one forward pass of `input_shape` with `torch.func.functional_call`;
   the model's own weights are not touched or copied.
2. Forward hooks on every conv (MACs = output elements x in_channels/groups x kernel area) and
   linear layer (MACs = output elements x in_features) add up the MACs. BN, ReLU, pooling and the
   residual additions (under 1% of a ResNet's cost) are not counted.
3. The model runs in eval mode for the count (BN on batch 1 in training mode is an error) and
   gets its previous train/eval flags back afterwards.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call


def count_macs(model: nn.Module, input_shape: Sequence[int] = (1, 3, 224, 224)) -> int:
    """Multiply-accumulates of one forward pass of a batch of `input_shape` (steps 1-3)."""
    total = [0]

    def conv_hook(m: nn.modules.conv._ConvNd, _inp: tuple, out: Tensor) -> None:
        total[0] += out.numel() * (m.in_channels // m.groups) * math.prod(m.kernel_size)

    def linear_hook(m: nn.Linear, _inp: tuple, out: Tensor) -> None:
        total[0] += out.numel() * m.in_features

    # 2. Hooks on convs and linears.
    handles = []
    for m in model.modules():
        if isinstance(m, nn.modules.conv._ConvNd):
            handles.append(m.register_forward_hook(conv_hook))
        elif isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(linear_hook))
    # 3. Eval mode for the count; remember the flags.
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        # 1. Meta tensors in place of the weights.
        tensors = {name: torch.empty_like(t, device="meta")
                   for name, t in (*model.named_parameters(), *model.named_buffers())}
        x = torch.empty(tuple(input_shape), device="meta")
        with torch.no_grad():
            functional_call(model, tensors, (x,))
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    return total[0]


def count_flops(model: nn.Module, input_shape: Sequence[int] = (1, 3, 224, 224)) -> int:
    """Forward FLOPs (= 2 x MACs, see the module docstring) of a batch of `input_shape`."""
    return 2 * count_macs(model, input_shape)
