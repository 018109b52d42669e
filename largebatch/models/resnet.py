"""ResNet-18/34/50/101/152 (He et al. 2016, arXiv 1512.03385) in the torchvision v1.5 layout.

Architecture, as built by `ResNet`:

1. Stem. "imagenet": 7x7/2 conv (64 channels) + BN + ReLU + 3x3/2 max-pool (224 px -> 56 px).
   "small" (28-32 px images): 3x3/1 conv + BN + ReLU, no max-pool (the image keeps its size).
2. Four stages of residual blocks with `width`, 2, 4 and 8 x `width` channels; the first block of
   stages 2-4 halves the resolution. BasicBlock (two 3x3 convs) for ResNet-18/34; Bottleneck
   (1x1 -> 3x3 -> 1x1, 4x expansion) for ResNet-50/101/152, with the stride on the 3x3 conv (v1.5:
   about 0.5% better top-1 than v1's stride on the first 1x1, and 4.1 vs 3.9 GMACs).
   A block whose shape changes has a 1x1 conv + BN projection shortcut.
3. Global average pool and one fully connected layer to `num_classes`.

Initialisation (Goyal et al., arXiv 1706.02677, section 5.1):

4. Convs: He normal, fan_out, ReLU gain. BN: gamma 1, beta 0. FC: weight ~ N(0, 0.01), bias 0.
5. `zero_init_residual`: gamma = 0 in the last BN of each residual block, so that every block
   starts as the identity (its shortcut BN keeps gamma 1).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

STEMS = ("imagenet", "small")


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels)


class BasicBlock(nn.Module):
    """Two 3x3 convs (ResNet-18/34). `last_bn` is the BN zeroed by zero_init_residual."""

    expansion = 1

    def __init__(self, in_ch: int, ch: int, stride: int) -> None:
        super().__init__()
        out_ch = ch * self.expansion
        self.conv1 = nn.Conv2d(in_ch, ch, 3, stride, 1, bias=False)
        self.bn1 = _bn(ch)
        self.conv2 = nn.Conv2d(ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = _bn(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = _projection(in_ch, out_ch, stride)

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride here: v1.5) -> 1x1 with 4x expansion (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, in_ch: int, ch: int, stride: int) -> None:
        super().__init__()
        out_ch = ch * self.expansion
        self.conv1 = nn.Conv2d(in_ch, ch, 1, bias=False)
        self.bn1 = _bn(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, stride, 1, bias=False)
        self.bn2 = _bn(ch)
        self.conv3 = nn.Conv2d(ch, out_ch, 1, bias=False)
        self.bn3 = _bn(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = _projection(in_ch, out_ch, stride)

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def _projection(in_ch: int, out_ch: int, stride: int) -> Optional[nn.Sequential]:
    """1x1 conv + BN shortcut when the block changes shape, else None (identity)."""
    if stride == 1 and in_ch == out_ch:
        return None
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), _bn(out_ch))


def init_weights(model: nn.Module) -> None:
    """Step 4: He normal (fan_out) convs, BN gamma 1 / beta 0, FC ~ N(0, 0.01) with zero bias."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.01)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class ResNet(nn.Module):
    """ResNet with an ImageNet or small-image stem; see the module docstring for the steps."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int], num_classes: int,
                 in_channels: int = 3, stem: str = "imagenet", zero_init_residual: bool = True,
                 width: int = 64) -> None:
        super().__init__()
        if stem not in STEMS:
            raise ValueError(f"stem must be one of {STEMS}, got {stem!r}")
        if width < 1 or num_classes < 1 or in_channels < 1:
            raise ValueError(f"width, num_classes and in_channels must be positive, got {width}, {num_classes}, {in_channels}")
        # 1. Stem.
        if stem == "imagenet":
            self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 7, 2, 3, bias=False), _bn(width),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        else:
            self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), _bn(width),
                                      nn.ReLU(inplace=True))
        # 2. Four stages; the first block of stages 2-4 has stride 2.
        stages, in_ch = [], width
        for i, blocks in enumerate(layers):
            ch = width * 2 ** i
            stage = []
            for j in range(blocks):
                stage.append(block(in_ch, ch, 2 if (i > 0 and j == 0) else 1))
                in_ch = ch * block.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        # 3. Pool and classify.
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)
        # 4. and 5. Initialisation.
        init_weights(self)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_bn.weight)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.pool(x).flatten(1))


def resnet18(**kw) -> ResNet:
    return ResNet(BasicBlock, [2, 2, 2, 2], **kw)


def resnet34(**kw) -> ResNet:
    return ResNet(BasicBlock, [3, 4, 6, 3], **kw)


def resnet50(**kw) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], **kw)


def resnet101(**kw) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 23, 3], **kw)


def resnet152(**kw) -> ResNet:
    return ResNet(Bottleneck, [3, 8, 36, 3], **kw)
