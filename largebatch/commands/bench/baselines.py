"""The plain PyTorch baselines that largebatch's benches compare against, in one place: the loops a user writes
without largebatch. largebatch's own side of every bench runs the product's step (`largebatch.step`); these
stay plain on purpose.

- `plain_step_fn`: `largebatch bench train`'s plain loop (zero_grad, cross-entropy, backward, SGD step), on
  largebatch's architecture or a peer library's model (`peer_model`: timm, torchvision).
- `plain_cnn`, `plain_epoch`: `largebatch bench speedrun`'s Keras-example CNN and its epoch of SGD.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


def stem(args) -> str:
    """The model stem for the bench's image size: the small one up to 64 px."""
    return "small" if args.image_size <= 64 else "imagenet"


def plain_step_fn(args, num_classes: int, device: torch.device, model: torch.nn.Module | None = None,
                  spec: dict | None = None) -> Callable[[], None]:
    """Step 2: the plain PyTorch loop, on the same architecture (fp32, NCHW, eager) or, for a peer, on its
    `model` with the settings of `spec` (precision, channels_last, compile)."""
    from largebatch.models import build_model

    spec = spec or {"precision": "fp32", "channels_last": False, "compile": False}
    torch.manual_seed(0)
    if model is None:
        model = build_model(args.model, num_classes, in_channels=3, stem=stem(args), width=args.width)
    fmt = torch.channels_last if spec["channels_last"] else torch.contiguous_format
    model = model.to(device, memory_format=fmt).train()  # type: ignore[call-overload]  # stubs omit memory_format
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    mode = spec["compile"] if isinstance(spec["compile"], str) else None
    forward = torch.compile(model, mode=mode) if spec["compile"] else model
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, num_classes, (args.batch,), device=device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["precision"])
    scaler = torch.amp.GradScaler(device.type, enabled=spec["precision"] == "fp16")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(forward(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return step


def peer_model(peer: str, name: str, num_classes: int) -> torch.nn.Module | str:
    """A peer library's model `name`, or the reason it cannot be had here (a string)."""
    try:
        if peer == "timm":
            import timm

            return timm.create_model(name, num_classes=num_classes, pretrained=False)
        import torchvision

        return getattr(torchvision.models, name)(num_classes=num_classes)
    except ImportError as err:
        return f"{peer} is not installed ({err})"
    except (AttributeError, RuntimeError) as err:
        return f"{peer} has no model {name!r} ({err})"


def plain_cnn(num_classes: int = 10) -> nn.Module:
    """Step 2: the classic small CNN for 28 x 28 grayscale images."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.25),
        nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, num_classes))


def plain_epoch(model: nn.Module, opt: torch.optim.Optimizer, loader) -> None:
    """One epoch of the plain loop over `loader`'s (images, labels) batches."""
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
