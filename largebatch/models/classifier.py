"""The classifier a run trains: normalisation as the model's first step, then the network of `model.name`."""
from __future__ import annotations

import torch
from torch import nn

from largebatch.config import Config


class Classifier(nn.Module):
    """Normalisation as the model's first step (data stays uint8 until here), then the network."""

    def __init__(self, normalize: nn.Module, net: nn.Module):
        super().__init__()
        self.normalize = normalize
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.normalize(x))


def build_classifier(cfg: Config, info, device: torch.device | None = None, channels_last: bool = False
                     ) -> Classifier:
    """The configured net behind the data set's normalization, on `device`, in channels-last memory if asked."""
    from largebatch.models import Normalize, build_model

    stem = cfg.model.stem
    if stem == "auto":
        stem = "small" if info.image_size <= 64 else "imagenet"
    net = build_model(cfg.model.name, num_classes=info.num_classes, in_channels=info.in_channels, stem=stem,
                      zero_init_residual=cfg.model.zero_init_residual, width=cfg.model.width)
    model = Classifier(Normalize(info.mean, info.std), net).to(device)
    # ignore: torch's stubs for Module.to omit memory_format (documented, accepted at run time)
    return model.to(memory_format=torch.channels_last) if channels_last else model  # type: ignore[call-overload]
