"""AlexNet-BN: AlexNet (Krizhevsky et al. 2012) with batch normalisation after every conv and
hidden fully connected layer, the model of the LARS paper (You, Gitman, Ginsburg, arXiv 1708.03888,
where BN replaces local response normalisation and makes batches of 8K+ trainable).

Architecture, as built by `AlexNetBN` (channels scaled by width/64; width=64 is the original):

1. Features. "imagenet" (224 px): 11x11/4 conv 96 -> BN -> ReLU -> 3x3/2 max-pool ->
   5x5 conv 256 -> BN -> ReLU -> 3x3/2 max-pool -> 3x3 convs 384, 384, 256 (each + BN + ReLU) ->
   3x3/2 max-pool -> adaptive average pool to 6x6 (256 x 6 x 6 = 9216 features).
   "small" (28-32 px): the first conv is 3x3/1 and the last max-pool is dropped; the map
   (6x6 at 28 px, 7x7 at 32 px) is average-pooled to 3x3 (2304 features).
2. Classifier: FC 4096 -> BN -> ReLU -> FC 4096 -> BN -> ReLU -> FC num_classes. No dropout
   (a choice of this implementation: the paper does not say whether AlexNet-BN keeps it).
3. Initialisation as for the ResNets: He normal (fan_out) convs, BN gamma 1 / beta 0,
   FC ~ N(0, 0.01) with zero bias.
"""
from __future__ import annotations

from torch import Tensor, nn

from largebatch.models.resnet import STEMS, init_weights


def _conv_bn(in_ch: int, out_ch: int, kernel: int, stride: int, padding: int) -> list[nn.Module]:
    return [nn.Conv2d(in_ch, out_ch, kernel, stride, padding, bias=False), nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True)]


def _fc_bn(in_f: int, out_f: int) -> list[nn.Module]:
    return [nn.Linear(in_f, out_f, bias=False), nn.BatchNorm1d(out_f), nn.ReLU(inplace=True)]


class AlexNetBN(nn.Module):
    """AlexNet with BN; see the module docstring for the steps."""

    def __init__(self, num_classes: int, in_channels: int = 3, stem: str = "imagenet", width: int = 64) -> None:
        super().__init__()
        if stem not in STEMS:
            raise ValueError(f"stem must be one of {STEMS}, got {stem!r}")
        if width < 1 or num_classes < 1 or in_channels < 1:
            raise ValueError(f"width, num_classes and in_channels must be positive, got {width}, {num_classes}, {in_channels}")
        c1, c2, c3, c4, c5, hidden = (max(1, round(c * width / 64)) for c in (96, 256, 384, 384, 256, 4096))
        # 1. Features (convs have no bias: BN follows).
        first = _conv_bn(in_channels, c1, 11, 4, 2) if stem == "imagenet" else _conv_bn(in_channels, c1, 3, 1, 1)
        layers = first + [nn.MaxPool2d(3, 2)]
        layers += _conv_bn(c1, c2, 5, 1, 2) + [nn.MaxPool2d(3, 2)]
        layers += _conv_bn(c2, c3, 3, 1, 1) + _conv_bn(c3, c4, 3, 1, 1) + _conv_bn(c4, c5, 3, 1, 1)
        if stem == "imagenet":
            layers.append(nn.MaxPool2d(3, 2))
        pooled = 6 if stem == "imagenet" else 3
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(pooled)
        # 2. Classifier.
        self.classifier = nn.Sequential(*_fc_bn(c5 * pooled * pooled, hidden), *_fc_bn(hidden, hidden),
                                        nn.Linear(hidden, num_classes))
        # 3. Initialisation.
        init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.pool(self.features(x)).flatten(1))


def alexnet_bn(num_classes: int, in_channels: int = 3, stem: str = "imagenet",
               zero_init_residual: bool = True, width: int = 64) -> AlexNetBN:
    """AlexNet-BN; `zero_init_residual` is accepted for a uniform signature and ignored (no residuals)."""
    del zero_init_residual
    return AlexNetBN(num_classes, in_channels, stem, width)
