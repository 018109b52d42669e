"""The classifier a run trains: normalisation as the model's first step, then the network of `model.name`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from largebatch.errors import UserError
from largebatch.placement import NARROW_CHANNELS, cpu_channels_last_hazard

if TYPE_CHECKING:
    from largebatch.config import ModelConfig


class Classifier(nn.Module):
    """Normalisation as the model's first step (data stays uint8 until here), then the network."""

    def __init__(self, normalize: nn.Module, net: nn.Module):
        super().__init__()
        self.normalize = normalize
        self.net = net
        self.channels_last = False   # the memory format it runs in (build_classifier), which batches must match
        self.channels_last_note: str | None = None   # why channels-last memory was asked for and not used
        self.built: dict = {}   # what model.name built (external.Built.record): checkpoints record it
        self.notes: list[str] = []   # said once by the run (e.g. zero-init asked for, not possible)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.normalize(x))


def _check_input_size(net: nn.Module, name: str, in_channels: int, size: int, key: str) -> None:
    """One image of the smallest training size through the new net (evaluation mode: no statistics change, no
    randomness drawn): a size its pooling cannot take is one sentence now, not a traceback at the first step."""
    net.eval()
    try:
        with torch.no_grad():
            net(torch.zeros(1, in_channels, size, size))
    except (RuntimeError, AssertionError, ValueError) as err:   # the last two: timm's shape asserts
        external = ":" in name
        if not external and not isinstance(err, RuntimeError):
            raise
        detail = " ".join(str(err).split())[:200] or type(err).__name__
        if external and "channel" in detail:
            raise UserError(f"model {name} cannot take the data's {in_channels}-channel images ({detail}); make "
                            "it for that many channels (a factory's in_channels argument).") from None
        fix = f"set {key} to a size it takes" if external else f"give a larger {key}"
        raise UserError(f"model {name} cannot take {size}x{size}-pixel images ({detail}); {fix}.") from None
    finally:
        net.train()


def check_input_size(name: str, size: int, key: str, *, in_channels: int = 3, stem: str = "small") -> None:
    """Whether model `name` takes `size`-pixel images, before any run: a narrow net (the spatial reductions do not
    depend on the width) on the meta device (shapes only, no memory); the same sentence as a run's, naming `key`.
    A model from elsewhere (`timm:`, `torchvision:`, a factory) is built at its own width on the meta device."""
    from largebatch.models import build_model

    with torch.device("meta"):
        net = build_model(name, num_classes=10, in_channels=in_channels, stem=stem, width=4)
        _check_input_size(net, name, in_channels, size, key)


def build_classifier(cfg: ModelConfig, info, device: torch.device | None = None, channels_last: bool = False,
                     phase_sizes: Sequence[int] = ()) -> Classifier:
    """The net of the run's ``model`` section (`cfg`) behind the data set's normalization (`info`), on `device`,
    in channels-last memory if asked; `phase_sizes`: the image sizes of data.resolution_phases, each of which the
    net must take."""
    from largebatch.models import Normalize, build_model_recorded

    stem = cfg.stem
    if stem == "auto":
        stem = "small" if info.image_size <= 64 else "imagenet"
    net, built = build_model_recorded(cfg.name, num_classes=info.num_classes, in_channels=info.in_channels,
                                      stem=stem, zero_init_residual=cfg.zero_init_residual, width=cfg.width)
    smallest = min([info.image_size, *phase_sizes])
    _check_input_size(net, cfg.name, info.in_channels, smallest,
                      "data.image_size" if smallest == info.image_size else "image_size in data.resolution_phases")
    model = Classifier(Normalize(info.mean, info.std), net).to(device)
    model.built = built.record()
    model.notes = [built.note] if built.note else []
    if cfg.bn_batch:
        from largebatch.models.ghost_bn import apply_bn_batch

        other = apply_bn_batch(net, cfg.bn_batch)
        if other:
            model.notes.append(f"model.bn_batch {cfg.bn_batch} applies to torch's BatchNorm2d layers; "
                               f"{len(other)} BN layers of other classes keep the whole batch (e.g. {other[0]}).")
    if ":" in cfg.name and (cfg.width != 64 or cfg.stem != "auto"):
        model.notes.append(f"model.width {cfg.width} and model.stem {cfg.stem} apply to largebatch's own "
                           f"models; {cfg.name} is built by its own constructor, which ignores them.")
    hazard = cpu_channels_last_hazard(model) if channels_last and (device is None or device.type == "cpu") else None
    if hazard:
        model.channels_last_note = (
            f"channels-last memory is off for this model on CPU: its 1x1 stride-2 convolution {hazard} is one that "
            f"torch's oneDNN kernel crashes on below {NARROW_CHANNELS} channels; model.width {NARROW_CHANNELS} or "
            "more allows it.")
        return model
    model.channels_last = channels_last
    # ignore: torch's stubs for Module.to omit memory_format (documented, accepted at run time)
    return model.to(memory_format=torch.channels_last) if channels_last else model  # type: ignore[call-overload]
