"""Image classifiers of largebatch: ResNet-18..152 (ImageNet or small-image stem), AlexNet-BN,
the `Normalize` input layer and the forward-cost counter; and models from anywhere (`external.py`).

`build_model(name, num_classes, ...)` is the one entry point; `MODELS` is a plain dict of
constructors taking (num_classes, in_channels, stem, zero_init_residual, width) as keywords. A name
with a colon (`timm:resnet50`, `torchvision:resnet50`, `my_pkg.my_module:make_model`) is built by
`largebatch.models.external`, which ignores `stem` and `width` (the run says so when they are set).
`build_model_recorded` also returns what was built (`external.Built`: the checkpoints record it).
"""
from __future__ import annotations

import re
from typing import Callable

from torch import nn

from largebatch.errors import UserError
from largebatch.models import external
from largebatch.models.alexnet import AlexNetBN, alexnet_bn
from largebatch.models.flops import count_flops, count_macs
from largebatch.models.normalize import Normalize
from largebatch.models.resnet import STEMS, ResNet, resnet18, resnet34, resnet50, resnet101, resnet152
from largebatch.models.speedrun import SpeedrunNet, speedrun_net

MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet50": resnet50,
    "resnet101": resnet101,
    "resnet152": resnet152,
    "alexnet_bn": alexnet_bn,
    "speedrun": speedrun_net,
}


def check_model_name(name: str, key: str = "model.name") -> None:
    """`name` is one of MODELS or a model from elsewhere that can be built (`external.check`); otherwise one
    sentence naming `key`, the setting or flag it came from."""
    if external.is_external(name):
        external.check(name, key)
    elif name not in MODELS:
        raise UserError(f"{key} is {name!r}; choose one of: {', '.join(MODELS)}, or timm:NAME, torchvision:NAME, "
                        "package.module:factory.")


def build_model(name: str, num_classes: int, in_channels: int = 3, stem: str = "imagenet",
                zero_init_residual: bool = True, width: int = 64) -> nn.Module:
    """The model `name` (MODELS or from elsewhere); user errors (unknown name, bad stem or sizes) raise UserError."""
    return build_model_recorded(name, num_classes, in_channels, stem, zero_init_residual, width)[0]


def build_model_recorded(name: str, num_classes: int, in_channels: int = 3, stem: str = "imagenet",
                         zero_init_residual: bool = True, width: int = 64) -> tuple[nn.Module, external.Built]:
    """`build_model`, and what it built (recorded in checkpoints)."""
    for key, value in (("num_classes", num_classes), ("in_channels", in_channels)):
        if not isinstance(value, int) or value < 1:
            raise UserError(f"{key} is {value!r}; it must be a positive integer.")
    if external.is_external(name):
        return external.build(name, num_classes, in_channels, zero_init_residual)
    check_model_name(name)
    if stem not in STEMS:
        raise UserError(f"unknown stem {stem!r}; choose one of: {', '.join(STEMS)} (model.stem).")
    if not isinstance(width, int) or width < 1:
        raise UserError(f"width is {width!r}; it must be a positive integer.")
    try:
        net = MODELS[name](num_classes=num_classes, in_channels=in_channels, stem=stem,
                           zero_init_residual=zero_init_residual, width=width)
    except RuntimeError as err:   # the allocator: the weights alone do not fit (an absurd model.width)
        if "allocate" not in str(err):
            raise
        tried = re.search(r"tried to allocate (\d+) bytes", str(err))
        size = f" (one weight tensor alone is {int(tried.group(1)) / 2**30:,.1f} GiB)" if tried else ""
        raise UserError(f"model {name} at width {width} does not fit in memory{size}; give a smaller model.width.") \
            from None
    zero = f"argument zero_init_residual={zero_init_residual}" if isinstance(net, ResNet) else "none (no residual)"
    return net, external.Built(name, "largebatch", f"{type(net).__module__}.{type(net).__qualname__}",
                               sum(p.numel() for p in net.parameters()), zero)


__all__ = ["MODELS", "build_model", "build_model_recorded", "check_model_name", "Normalize", "count_flops", "count_macs", "ResNet", "AlexNetBN", "SpeedrunNet"]
