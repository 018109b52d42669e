"""The data layer: sources of uint8 NCHW batches and the exactly-once samplers.

``build_data(cfg.data, seed)`` returns ``(train, test, info)``. A source has
``__len__``, a ``corrupt`` list of skipped files, and
``batches(index_batches, *, train, epoch)`` that yields ``(x_uint8_nchw, y_int64)``
for each index batch, in order. Index batches come from ``largebatch.data.sampler``.
Augmentation is a function of ``(seed, epoch, image index)``, so any number of loader
workers, ranks, or a resumed run give identical batches. Pixels stay uint8 until the
model's ``Normalize(info.mean, info.std)``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F

from largebatch.data.info import FASHION_MNIST_ROOT, IMAGENET_MEAN, IMAGENET_STD, DatasetInfo, Source
from largebatch.errors import UserError

__all__ = ["FASHION_MNIST_ROOT", "IMAGENET_MEAN", "IMAGENET_STD", "DatasetInfo", "Source", "build_data"]


def _channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 NCHW images, in 0..1 units (exact integer sums, from each channel's
    histogram of the 256 values: one pass over the pixels, no 64-bit copy of them)."""
    values = torch.arange(256, dtype=torch.int64)
    means, stds = [], []
    for ch in range(images.shape[1]):
        counts = torch.bincount(images[:, ch].reshape(-1), minlength=256)
        count = int(counts.sum())
        mean = int((counts * values).sum()) / count
        var = int((counts * values * values).sum()) / count - mean * mean
        means.append(mean / 255)
        stds.append(max(var, 0.0) ** 0.5 / 255)
    return tuple(means), tuple(stds)


def _resize_uint8(images: torch.Tensor, size: int) -> torch.Tensor:
    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    out = F.interpolate(images.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def _build_idx(cfg, seed: int) -> tuple[Source, Source, DatasetInfo]:
    from largebatch.data import idx
    from largebatch.data.memory import MemorySource

    root = cfg.root or FASHION_MNIST_ROOT
    train_x, train_y = idx.load_split(root, "train")
    test_x, test_y = idx.load_split(root, "t10k")
    train_x = _resize_uint8(train_x, cfg.image_size)
    test_x = _resize_uint8(test_x, cfg.image_size)
    mean, std = _channel_stats(train_x)
    num_classes = int(max(train_y.max(), test_y.max())) + 1
    train = MemorySource(train_x, train_y, seed=seed, augment=cfg.augment, padding=cfg.crop_padding)
    test = MemorySource(test_x, test_y, seed=seed, augment=False, padding=0)
    name = "fashion_mnist" if cfg.dataset == "fashion_mnist" else f"idx:{Path(root).name}"
    return train, test, DatasetInfo(num_classes, 1, cfg.image_size, mean, std, len(train), len(test), name)


def _build_synthetic(cfg, seed: int) -> tuple[Source, Source, DatasetInfo]:
    from largebatch.data.synthetic import SyntheticSource

    if cfg.num_classes < 2:
        raise UserError(f"data.num_classes is {cfg.num_classes}; the synthetic source needs at least 2.")
    if cfg.synthetic_size < 1:
        raise UserError(f"data.synthetic_size is {cfg.synthetic_size}; it must be positive.")
    train = SyntheticSource(cfg.synthetic_size, cfg.num_classes, cfg.image_size, seed=seed,
                            augment=cfg.augment, padding=cfg.crop_padding)
    test_size = max(1, cfg.synthetic_size // 8)
    test = SyntheticSource(test_size, cfg.num_classes, cfg.image_size, seed=seed + 1, augment=False, padding=0)
    uniform_std = (255 * 257 / 12) ** 0.5 / 255  # std of a uniform integer in 0..255
    return train, test, DatasetInfo(cfg.num_classes, 3, cfg.image_size, (0.5,) * 3, (uniform_std,) * 3,
                                    len(train), len(test), "synthetic")


class IndexedSource:
    """The images `keep` of a source, renumbered 0..len(keep)-1 (data.subset, data.val_split)."""

    def __init__(self, source: Source, keep: torch.Tensor) -> None:
        self.source = source
        self.keep = keep.sort().values
        self.corrupt = source.corrupt

    def __len__(self) -> int:
        return self.keep.numel()

    def batches(self, index_batches: Iterable[torch.Tensor], *, train: bool, epoch: int
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        mapped = (self.keep[torch.as_tensor(i, dtype=torch.int64)] for i in index_batches)
        return self.source.batches(mapped, train=train, epoch=epoch)

    def close(self) -> None:
        if hasattr(self.source, "close"):
            self.source.close()


def _fixed_permutation(n: int, salt: int) -> torch.Tensor:
    """A permutation of 0..n-1 that depends on `salt` alone: the same for every train.seed."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(salt), dtype=torch.int64)


def build_data(cfg, seed: int) -> tuple[Source, Source, DatasetInfo]:
    """(train, test, info) for the `data` section of the config.

    data.val_split holds out that many training images (fixed, the same for every seed) and returns them in
    the place of the test set, so every evaluation of a tuning run is on the validation split; data.subset
    then takes a fixed subset of the remaining training images.
    """
    subset = getattr(cfg, "subset", None)
    val_split = getattr(cfg, "val_split", None)
    try:
        train, test, info = _build_data(cfg, seed)
    except RuntimeError as err:   # the allocator: in-memory images at an absurd size or padding
        if "allocate" not in str(err):
            raise
        keys = ["image_size", "crop_padding"] + (["synthetic_size"] if cfg.dataset == "synthetic" else [])
        given = ", ".join(f"data.{k}={getattr(cfg, k)}" for k in keys)
        raise UserError(f"the {cfg.dataset} images do not fit in memory at {given}; give smaller values "
                        f"({' or '.join('data.' + k for k in keys)}).") from None
    if val_split is not None:
        if not 0 < val_split < len(train):
            raise UserError(f"data.val_split is {val_split}; give a number of images in 1..{len(train) - 1} "
                            "(some must stay for training) or null.")
        order = _fixed_permutation(len(train), 104729)
        base = train
        test = IndexedSource(base, order[:val_split])
        train = IndexedSource(base, order[val_split:])
    if subset is not None:
        if not 0 < subset <= len(train):
            raise UserError(f"data.subset is {subset}; give a number of images in 1..{len(train)} or null.")
        train = IndexedSource(train, _fixed_permutation(len(train), 7919)[:subset])   # the same whatever train.seed
    if val_split is not None or subset is not None:
        info = DatasetInfo(info.num_classes, info.in_channels, info.image_size, info.mean, info.std, len(train),
                           len(test), info.name + (f"+val{val_split}" if val_split else ""), info.classes)
    return train, test, info


def _build_data(cfg, seed: int) -> tuple[Source, Source, DatasetInfo]:
    if cfg.crop_padding < 0:
        raise UserError(f"data.crop_padding is {cfg.crop_padding}; it must be zero or more.")
    if cfg.loader_workers < 0:
        raise UserError(f"data.loader_workers is {cfg.loader_workers}; it must be zero or more.")
    if not 0 < cfg.min_scale <= 1:
        raise UserError(f"data.min_scale is {cfg.min_scale}; it must be in (0, 1].")
    if cfg.dataset in ("fashion_mnist", "idx"):
        return _build_idx(cfg, seed)
    if cfg.dataset == "synthetic":
        return _build_synthetic(cfg, seed)
    if cfg.dataset == "imagefolder":
        from largebatch.data.imagefolder import build_imagefolder

        return build_imagefolder(cfg, seed)
    if cfg.dataset == "shards":
        from largebatch.data.shards import build_shards

        return build_shards(cfg, seed)
    if cfg.dataset == "webdataset":
        from largebatch.data.wds import build_webdataset

        return build_webdataset(cfg, seed)
    raise UserError(f"data.dataset is {cfg.dataset!r}; valid: fashion_mnist, idx, imagefolder, shards, synthetic, "
                    "webdataset.")
