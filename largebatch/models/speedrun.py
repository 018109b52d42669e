"""A small fast network for 28-32 px images: the airbench layout (Jordan, "94% on CIFAR-10 in 3.29
seconds", github.com/KellerJordan/cifar10-airbench), shrunk for two CPU cores.

airbench spends its FLOPs where the image is already small: every stage convolves, then max-pools,
so the second conv of a stage runs at a quarter of the pixels. Layout, as built by `SpeedrunNet`:

1. Stem: 3x3/1 conv (`width` channels, no bias) + BN + GELU at full resolution.
2. Three stages with 2, 4 and 8 x `width` channels. Each stage: 3x3 conv -> 2x2 max-pool -> BN ->
   GELU -> 3x3 conv -> BN -> GELU, then the residual sum of the pooled branch and the second conv
   (a projection-free shortcut: both have the stage's channels), 28 -> 14 -> 7 -> 3 px.
3. Global max pool, one linear layer to `num_classes` (no bias), its logits multiplied by a fixed
   `scale` (airbench's 1/9 temperature, here 1/4: a small net at initialisation gives near-uniform
   probabilities, so the first steps are not wasted on over-confident logits).

Max, as in airbench, not average pooling: average pooling trained clearly worse here (width 12, 2 workers,
the default recipe: 0.9034 final test top-1 against 0.9211 with max pooling; 0.791 / 0.881 against
0.897 / 0.915 at epochs 2 / 4). The price: a max-pool routes each window's gradient by the order of its
top two values, and with about 10^5 windows per batch some are within float rounding of each other, so two
mathematically equal runs (DDP on 2 workers vs 2 accumulated micro-batches) drift apart by about 1e-3 after
3 steps instead of 1e-6 (breaking exact ties with fixed offsets only brought it to 5e-5). Exact-equivalence
tests of the trainer must use a model without max-pools (e.g. resnet18).

`act` picks the activation: GELU (airbench's, the default) or ReLU (about 5% faster per step on this
CPU, `scripts/profile_step.py --variants cl,relu`; at 5 epochs it trained no better, docs/benchmarks.md at f9c730e).

Initialisation: convs and the linear layer use torch's default (Kaiming uniform, a = sqrt(5)); BN gamma 1,
beta 0. With `zero_init_residual` the last BN gamma of each stage starts at 0, so each stage starts as
conv -> pool -> BN -> GELU (the same switch as the ResNets').

Forward cost at 28 px with width 16: about 15 MMACs per image (`count_macs`), versus 0.56 GMACs
for ResNet-18 with the small stem at width 64.
"""
from __future__ import annotations

from torch import Tensor, nn

STEMS = ("imagenet", "small")
ACTS = {"gelu": nn.GELU, "relu": nn.ReLU}


class ConvStage(nn.Module):
    """Step 2: conv -> pool -> BN -> GELU -> conv -> BN -> GELU, plus the pooled branch as shortcut."""

    def __init__(self, in_ch: int, out_ch: int, act: type[nn.Module] = nn.GELU) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, 1, 1, bias=False)
        self.pool = nn.MaxPool2d(2)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.act = act()

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: Tensor) -> Tensor:
        x = self.act(self.bn1(self.pool(self.conv1(x))))
        return x + self.act(self.bn2(self.conv2(x)))


class SpeedrunNet(nn.Module):
    """See the module docstring for the steps. `stem` is accepted for the MODELS signature; both
    values build the same full-resolution stem (this net is for small images only)."""

    def __init__(self, num_classes: int, in_channels: int = 1, stem: str = "small",
                 zero_init_residual: bool = True, width: int = 16, scale: float = 0.25,
                 act: str = "gelu") -> None:
        super().__init__()
        if act not in ACTS:
            raise ValueError(f"act must be one of {tuple(ACTS)}, got {act!r}")
        if stem not in STEMS:
            raise ValueError(f"stem must be one of {STEMS}, got {stem!r}")
        if width < 1 or num_classes < 1 or in_channels < 1:
            raise ValueError(f"width, num_classes and in_channels must be positive, got {width}, {num_classes}, {in_channels}")
        # 1. Stem.
        a = ACTS[act]
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), a())
        # 2. Three stages, each halving the resolution.
        stages = [ConvStage(width, 2 * width, a), ConvStage(2 * width, 4 * width, a),
                  ConvStage(4 * width, 8 * width, a)]
        self.stages = nn.Sequential(*stages)
        # 3. Max pool and a scaled linear classifier.
        self.pool = nn.AdaptiveMaxPool2d(1)
        self.fc = nn.Linear(8 * width, num_classes, bias=False)
        self.scale = scale
        if zero_init_residual:
            for stage in stages:
                nn.init.zeros_(stage.last_bn.weight)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        return self.fc(self.pool(x).flatten(1)) * self.scale


def speedrun_net(**kw) -> SpeedrunNet:
    return SpeedrunNet(**kw)
