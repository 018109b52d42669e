"""What every part of the data layer shares: a data set's description, the source protocol, the
normalisation constants and the default Fashion-MNIST location."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol

import torch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"


@dataclass(frozen=True)
class DatasetInfo:
    num_classes: int
    in_channels: int
    image_size: int
    mean: tuple[float, ...]  # per channel, in 0..1 units
    std: tuple[float, ...]
    train_size: int
    test_size: int
    name: str


class Source(Protocol):
    corrupt: list[str]

    def __len__(self) -> int: ...

    def batches(self, index_batches: Iterable[torch.Tensor], *, train: bool, epoch: int
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...
