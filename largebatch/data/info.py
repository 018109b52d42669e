"""What every part of the data layer shares: a data set's description, the source protocol, the
normalisation constants and the default Fashion-MNIST location."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
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
    classes: tuple[str, ...] | None = None   # class names by label, where the data set has them (ImageFolder)


class Source(Protocol):
    corrupt: list[str]

    def __len__(self) -> int: ...

    def batches(self, index_batches: Iterable[torch.Tensor], *, train: bool, epoch: int
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...


def check_classes(run_dir: Path, classes: tuple[str, ...] | None, *, write: bool) -> None:
    """A run's class names (labels in order) are kept in run_dir/classes.json: written at its start (`write`), and
    compared on a resume and by `evaluate`, so that labels never shift under a trained model (a class folder
    added or renamed under data.root)."""
    from largebatch.errors import UserError
    from largebatch.checkpoint import atomic_write

    if classes is None:
        return
    path = run_dir / "classes.json"
    if path.is_file():
        try:
            kept = json.loads(path.read_text())
        except (OSError, ValueError):
            kept = None
        if isinstance(kept, list) and tuple(kept) != classes:
            diff = next((i for i, (a, b) in enumerate(zip(kept, classes)) if a != b), min(len(kept), len(classes)))
            raise UserError(f"the classes under data.root differ from those this run was trained with ({path}: "
                            f"{len(kept)} classes, now {len(classes)}, first difference at label {diff}); point "
                            "data.root at the data the run was trained with.")
        if isinstance(kept, list):
            return
    if write:
        atomic_write(path, (json.dumps(list(classes), indent=0) + "\n").encode())
