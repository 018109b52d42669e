"""ImageNet-style JPEG trees (root/train/<class>/*.jpg, root/val/<class>/*.jpg).

1. Scan: class names are the sorted sub-directories of ``train/``; ``val/`` must use
   the same names. File lists are sorted, so image ``i`` is the same file on every
   rank and in every run; paths are kept in a numpy string array (no per-object
   reference counts for forked workers to copy).
2. Load: a torch ``DataLoader`` whose items are whole index batches
   (``batch_size=None``): each loader worker decodes one batch into one uint8 buffer
   with ``jpeg.decode_crop`` (DCT-scaled decode, random-resized-crop or centre crop,
   flip). Workers are persistent; batches come back in order; memory is pinned when
   CUDA is available. The item carries ``(epoch, train, indices)``, so persistent
   workers need no state from the main process.
3. Corrupt files: a worker never raises on a bad file; it drops the image (the batch
   gets smaller) and returns the path. The main process appends it to
   ``source.corrupt`` and, with ``on_corrupt=fail``, raises a UserError naming it.
4. Batches are ``(x, y)`` with ``x`` logically N x 3 x S x S uint8 and stored
   channels-last (NHWC), which is what a channels-last model wants and saves a
   transpose per image.
5. With ``data.decode`` gpu the workers only read and plan, and the training process
   decodes and crops on the GPU (largebatch/data/gpu_jpeg.py); x is then on the GPU.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from largebatch.data import jpeg
from largebatch.errors import UserError

EXTENSIONS = (".jpg", ".jpeg", ".jpe")


def scan(root: Path, split: str, classes: list[str] | None = None) -> tuple[list[str], np.ndarray, torch.Tensor]:
    """Step 1: (classes, paths, labels) of root/split."""
    base = root / split
    if not base.is_dir():
        raise UserError(f"ImageFolder split {base} is missing; data.root must contain train/ and val/ "
                        f"with one sub-directory of JPEGs per class.")
    found = sorted(e.name for e in os.scandir(base) if e.is_dir())
    if classes is None:
        classes = found
    else:
        extra = sorted(set(found) - set(classes))
        if extra:
            raise UserError(f"{base} has classes {extra[:5]} that train/ does not have; "
                            f"use the same class folders in train/ and val/.")
    paths: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        folder = base / name
        if not folder.is_dir():
            continue
        files = sorted(e.path for e in os.scandir(folder)
                       if e.is_file() and e.name.lower().endswith(EXTENSIONS))
        if not files and split == "train":
            raise UserError(f"ImageFolder class folder {folder} has no JPEG files (*.jpg, *.jpeg); put the class's "
                            "training images there or remove the folder.")
        paths += files
        labels += [label] * len(files)
    if not paths:
        raise UserError(f"ImageFolder split {base} has no JPEG files (*.jpg, *.jpeg) in its class folders; "
                        f"put images in {base}/<class>/.")
    if split == "train" and len(classes) < 2:
        raise UserError(f"ImageFolder split {base} has {len(classes)} class folder(s); a classifier needs 2 or more, "
                        f"one sub-directory of JPEGs per class.")
    return classes, np.array(paths), torch.tensor(labels, dtype=torch.int64)


class BatchDecoder(Dataset):
    """Step 2: item (epoch, train, indices) -> (x NHWC uint8, y, kept indices, corrupt paths)."""

    def __init__(self, paths: np.ndarray, labels: torch.Tensor, size: int, min_scale: float, seed: int) -> None:
        self.paths = paths
        self.labels = labels
        self.size = size
        self.min_scale = min_scale
        self.seed = seed

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, item: tuple[int, bool, torch.Tensor]):
        epoch, train, indices = item
        out = torch.empty((len(indices), self.size, self.size, 3), dtype=torch.uint8)
        kept: list[int] = []
        corrupt: list[str] = []
        for i in indices.tolist():
            path = str(self.paths[i])
            try:
                with open(path, "rb") as f:
                    data = f.read()
                jpeg.decode_crop(data, self.size, train=train, min_scale=self.min_scale, seed=self.seed,
                                 epoch=epoch, index=i, out=out[len(kept)])
            except (jpeg.CorruptImage, OSError):  # step 3: skip, report, keep the worker alive
                corrupt.append(path)
                continue
            kept.append(i)
        kept_t = torch.tensor(kept, dtype=torch.int64)
        x = out[:len(kept)].permute(0, 3, 1, 2)  # step 4: NCHW view of NHWC memory
        return x, self.labels[kept_t], corrupt


class _Feed:
    """The loader's sampler: yields whatever items the current `batches` call set."""

    def __init__(self) -> None:
        self.items: Iterable = ()

    def __iter__(self):
        return iter(self.items)


class ImageFolderSource:
    def __init__(self, paths: np.ndarray, labels: torch.Tensor, *, size: int, min_scale: float, seed: int,
                 augment: bool, workers: int, on_corrupt: str, gpu: bool = False, gpu_cache_gb: float = 0.0,
                 gpu_decoder: str = "auto") -> None:
        from largebatch.data import gpu_jpeg

        self.decoder: Dataset = (gpu_jpeg.PlanDecoder if gpu else BatchDecoder)(paths, labels, size, min_scale, seed)
        self.finisher = gpu_jpeg.GpuFinisher(size, gpu_cache_gb, decoder=gpu_decoder) if gpu else None
        self.labels = labels
        self.augment = augment
        self.workers = workers
        self.on_corrupt = on_corrupt
        self.corrupt: list[str] = []
        self._feed = _Feed()
        self._loader: DataLoader | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def _get_loader(self) -> DataLoader:
        if self._loader is None:
            kwargs: dict[str, Any] = {}
            if self.workers > 0:
                kwargs = dict(persistent_workers=True, prefetch_factor=4)
            self._loader = DataLoader(self.decoder, batch_size=None, sampler=self._feed, num_workers=self.workers,
                                      pin_memory=torch.cuda.is_available(), **kwargs)
        return self._loader

    def batches(self, index_batches: Iterable[torch.Tensor], *, train: bool, epoch: int
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        augment = bool(train and self.augment)
        self._feed.items = ((epoch, augment, torch.as_tensor(b, dtype=torch.int64)) for b in index_batches)
        items = self._get_loader()
        finished = map(self.finisher, items) if self.finisher is not None else items
        for x, y, corrupt in finished:
            if corrupt:
                self.corrupt += corrupt
                if self.on_corrupt == "fail":
                    raise UserError(f"corrupt or truncated image {corrupt[0]}; replace or delete it, "
                                    f"or set data.on_corrupt=skip to skip such files.")
                if len(y) == 0 and train:
                    raise UserError(f"every image of a training batch was corrupt or unreadable (e.g. {corrupt[0]}); "
                                    "check the files under data.root.")
            yield x, y

    def close(self) -> None:
        """Stop the persistent loader workers."""
        self._loader = None


def build_imagefolder(cfg, seed: int):
    from largebatch.data.info import IMAGENET_MEAN, IMAGENET_STD, DatasetInfo

    root = Path(cfg.root)
    if root.exists() and not root.is_dir():
        raise UserError(f"data.root {root} is a file, not a directory; set data.root to a directory with train/ "
                        "and val/.")
    if not root.is_dir():
        raise UserError(f"ImageFolder root {root} does not exist; set data.root to a directory with train/ and val/.")
    classes, train_paths, train_labels = scan(root, "train")
    _, val_paths, val_labels = scan(root, "val", classes)
    from largebatch.data.gpu_jpeg import check_decode

    common = dict(size=cfg.image_size, min_scale=cfg.min_scale, seed=seed, workers=cfg.loader_workers,
                  on_corrupt=cfg.on_corrupt, gpu=check_decode(cfg.decode, cfg.dataset), gpu_cache_gb=cfg.gpu_cache_gb,
                  gpu_decoder=cfg.gpu_decoder)
    train = ImageFolderSource(train_paths, train_labels, augment=cfg.augment, **common)
    test = ImageFolderSource(val_paths, val_labels, augment=False, **common)
    info = DatasetInfo(len(classes), 3, cfg.image_size, IMAGENET_MEAN, IMAGENET_STD, len(train), len(test),
                       f"imagefolder:{root.name}")
    return train, test, info
