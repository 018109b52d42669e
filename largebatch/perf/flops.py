"""Model cost for the performance model: forward FLOPs per image and gradient element count.

Convention (the same as `largebatch.models.flops`): 1 MAC = 2 FLOPs; the "4.1 GFLOPs" quoted for
ResNet-50 at 224 px is 4.1 G MACs = 8.2 GFLOPs. A training step costs 3 x forward FLOPs
(backward = 2 x forward: gradients with respect to activations and to weights).

1. Build the model from `largebatch.models.build_model` on the meta device (no memory, no arithmetic).
2. Count forward FLOPs for one image with `count_flops` and the parameters (= gradient elements).
3. Cache the result per (model, image size, channels, classes, stem, width).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class ModelCost:
    name: str
    image_size: int
    forward_flops: float   # per image, FLOPs (2 x MACs)
    params: int            # trainable parameters = gradient elements per all-reduce


@lru_cache(maxsize=64)
def model_cost(name: str, image_size: int = 224, in_channels: int = 3, num_classes: int = 1000,
               stem: str = "imagenet", width: int = 64) -> ModelCost:
    """Forward FLOPs per image and parameter count of a largebatch model (steps 1-3)."""
    from largebatch.models import build_model, count_flops

    if image_size < 1:
        from largebatch.errors import UserError
        raise UserError(f"image size {image_size} must be a positive integer.")
    try:
        with torch.device("meta"):  # 1. shapes only
            model = build_model(name, num_classes, in_channels=in_channels, stem=stem, width=width)
        flops = count_flops(model, (1, in_channels, image_size, image_size))  # 2.
    except (RuntimeError, MemoryError, OverflowError) as err:   # a tensor too large to describe, even on meta
        from largebatch.errors import UserError
        raise UserError(f"model {name} at width {width}, {in_channels} input channels, {num_classes} classes and "
                        f"{image_size} px images is too large to describe ({type(err).__name__}); give smaller "
                        "values (--width, --num-classes, --in-channels, --image-size).") from None
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return ModelCost(name, image_size, float(flops), int(params))
