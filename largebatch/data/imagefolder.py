"""ImageNet-style image trees (root/train/<class>/*.JPEG; root/val/<class>/*.JPEG or ImageNet's flat val/ with
a label file; docs/imagenet.md).

1. Scan: class names are the sorted non-hidden sub-directories of ``train/`` (torchvision's
   ImageFolder order; a hidden folder such as .ipynb_checkpoints is ignored, saying so);
   ``val/`` uses the same names, or is one flat folder labelled by a label file. Inside a
   class folder, images of torchvision's extensions in nested folders too, in
   torchvision's order; so image ``i`` is the same file on every rank and in every run.
   Paths are kept in a numpy string array (no per-object reference counts for forked
   workers to copy).
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
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from largebatch.data import jpeg
from largebatch.errors import UserError

# What torchvision's ImageFolder reads (torchvision.datasets.folder.IMG_EXTENSIONS), and ".jpe"; a file that is
# not a JPEG is decoded by Pillow (largebatch/data/jpeg.py).
EXTENSIONS = (".jpg", ".jpeg", ".jpe", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
KAGGLE_VAL_LABELS = "LOC_val_solution.csv"   # Kaggle's ImageNet: ImageId,PredictionString ("<wnid> x y x y ...")


def _say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":   # once per run, not once per rank
        print(f"largebatch: {line}", file=sys.stderr, flush=True)


def _images(folder: Path) -> tuple[list[str], list[str]]:
    """(image files under `folder`, nested folders included, in torchvision's ImageFolder order: the folders
    sorted by path, each one's files by name; hidden files and folders skipped, and their names)."""
    found: list[tuple[str, list[str]]] = []
    hidden: list[str] = []
    for top, dirs, files in os.walk(folder, followlinks=True):
        hidden += [os.path.join(top, d) for d in dirs if d.startswith(".")]
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found.append((top, sorted(f for f in files if not f.startswith(".") and f.lower().endswith(EXTENSIONS))))
    return [os.path.join(top, f) for top, files in sorted(found) for f in files], hidden


def scan(root: Path, split: str, classes: list[str] | None = None, val_labels: str | None = None
         ) -> tuple[list[str], np.ndarray, torch.Tensor]:
    """Step 1: (classes, paths, labels) of root/split. Classes are the sorted non-hidden sub-folders of train/
    (torchvision's order); a val/ without class folders is ImageNet's flat layout, labelled by a label file
    (`_flat_val`)."""
    base = root / split
    if not base.is_dir():
        raise UserError(f"ImageFolder split {base} is missing; data.root must contain train/ and val/ "
                        f"with one sub-directory of images per class (docs/imagenet.md shows the layouts read).")
    entries = [e for e in os.scandir(base) if e.is_dir()]
    found = sorted(e.name for e in entries if not e.name.startswith("."))
    hidden = sorted(e.name for e in entries if e.name.startswith("."))
    if hidden:
        _say(f"{base}: hidden folder(s) {', '.join(hidden[:5])} ignored (not classes).")
    if split == "val" and classes is not None and not found:
        return classes, *_flat_val(root, base, classes, val_labels)
    if classes is None:
        classes = found
    else:
        extra = sorted(set(found) - set(classes))
        if extra:
            raise UserError(f"{base} has classes {extra[:5]} that train/ does not have; "
                            f"use the same class folders in train/ and val/.")
    paths: list[str] = []
    labels: list[int] = []
    skipped: list[str] = []
    for label, name in enumerate(classes):
        folder = base / name
        if not folder.is_dir():
            continue
        files, hidden_inside = _images(folder)
        skipped += hidden_inside
        if not files and split == "train":
            raise UserError(f"ImageFolder class folder {folder} has no images (*.jpg, *.jpeg, *.png, ...); put the "
                            "class's training images there or remove the folder.")
        paths += files
        labels += [label] * len(files)
    if skipped:
        _say(f"{base}: {len(skipped)} hidden folder(s) inside class folders ignored, e.g. {skipped[0]}.")
    if not paths:
        raise UserError(f"ImageFolder split {base} has no images (*.jpg, *.jpeg, *.png, ...) in its class folders; "
                        f"put images in {base}/<class>/.")
    if split == "train" and len(classes) < 2:
        raise UserError(f"ImageFolder split {base} has {len(classes)} class folder(s); a classifier needs 2 or more, "
                        f"one sub-directory of images per class.")
    return classes, np.array(paths), torch.tensor(labels, dtype=torch.int64)


def find_val_labels(root: Path, given: str | None) -> Path | None:
    """The label file of a flat val/: `data.val_labels`, else Kaggle's LOC_val_solution.csv in data.root or up to
    three folders above it (Kaggle's data.root is ILSVRC/Data/CLS-LOC, the file beside ILSVRC/)."""
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise UserError(f"data.val_labels {path} is not a file; give the label file of the flat val/ folder "
                            f"(e.g. {KAGGLE_VAL_LABELS}).")
        return path
    for folder in [root, *list(root.resolve().parents)[:3]]:
        if (folder / KAGGLE_VAL_LABELS).is_file():
            return folder / KAGGLE_VAL_LABELS
    return None


def read_val_labels(path: Path) -> dict[str, str]:
    """File name (without extension) -> class folder name. Kaggle's CSV (ImageId,PredictionString: the class is
    the first word of PredictionString), or lines of `<file> <class>` or `<file>,<class>`."""
    out: dict[str, str] = {}
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"data.val_labels {path} cannot be read ({type(err).__name__}); give a text label file.") from None
    kaggle = bool(lines) and lines[0].replace(" ", "").lower().startswith("imageid,predictionstring")
    for n, line in enumerate(lines[1:] if kaggle else lines, start=2 if kaggle else 1):
        if not line.strip():
            continue
        fields = [f for f in (line.split(",", 1) if "," in line else line.split()) if f.strip()]
        label = fields[1].split()[0] if len(fields) == 2 and fields[1].split() else None
        if label is None:
            raise UserError(f"{path} line {n} ({line.strip()[:60]!r}) has no class; each line names an image and its "
                            "class folder name (wnid), as in Kaggle's LOC_val_solution.csv.")
        out[os.path.splitext(fields[0].strip())[0]] = label
    if not out:
        raise UserError(f"{path} holds no labels; give the label file of the flat val/ folder.")
    return out


def _flat_val(root: Path, base: Path, classes: list[str], given: str | None) -> tuple[np.ndarray, torch.Tensor]:
    """ImageNet's validation set as ILSVRC2012 and Kaggle ship it: val/ILSVRC2012_val_*.JPEG, one flat folder,
    labelled by a label file (`find_val_labels`). Every image needs a label and every label an image and a class
    of train/; labels are class indices of train/ (the same as in class-folder layouts)."""
    files, _ = _images(base)
    files = [f for f in files if os.path.dirname(f) == str(base)]
    if not files:
        raise UserError(f"ImageFolder split {base} has neither class folders nor images; put the validation images "
                        f"in {base}/<class>/ or in {base} itself with a label file (data.val_labels).")
    path = find_val_labels(root, given)
    if path is None:
        raise UserError(f"{base} is a flat folder of {len(files)} images without class folders and no label file was "
                        f"found; set data.val_labels to its label file ({KAGGLE_VAL_LABELS} from Kaggle, or lines of "
                        "'<file> <wnid>'), or sort val/ into class folders.")
    labels = read_val_labels(path)
    index = {name: i for i, name in enumerate(classes)}
    unknown = sorted({c for c in labels.values() if c not in index})
    if unknown:
        raise UserError(f"{path} names class(es) {unknown[:3]} that train/ does not have; use the label file that "
                        "belongs to this training set.")
    stems = {os.path.splitext(os.path.basename(f))[0]: f for f in files}
    unlabelled = sorted(set(stems) - set(labels))
    if unlabelled:
        raise UserError(f"{len(unlabelled)} image(s) in {base} have no label in {path}, e.g. {unlabelled[0]}; give "
                        "the complete label file or move those images out of val/.")
    missing = sorted(set(labels) - set(stems))
    if missing:
        raise UserError(f"{path} labels {len(missing)} image(s) that {base} does not have, e.g. {missing[0]}; give "
                        "the label file of this val/ folder, or restore the missing images.")
    _say(f"{base}: a flat validation folder of {len(files)} images, labelled by {path}.")
    return np.array(files), torch.tensor([index[labels[os.path.splitext(os.path.basename(f))[0]]] for f in files],
                                         dtype=torch.int64)


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


def split_cache(cache_gb: float, train_images: int, test_images: int) -> tuple[float, float]:
    """data.gpu_cache_gb is one budget for the run (largebatch/memory.py subtracts it once from the memory the
    micro-batch may use): the training and the evaluation source share it by their numbers of images."""
    total = train_images + test_images
    if cache_gb <= 0 or total == 0:
        return 0.0, 0.0
    return cache_gb * train_images / total, cache_gb * test_images / total


def build_imagefolder(cfg, seed: int):
    from largebatch.data.info import IMAGENET_MEAN, IMAGENET_STD, DatasetInfo

    root = Path(cfg.root)
    if root.exists() and not root.is_dir():
        raise UserError(f"data.root {root} is a file, not a directory; set data.root to a directory with train/ "
                        "and val/.")
    if not root.is_dir():
        raise UserError(f"ImageFolder root {root} does not exist; set data.root to your ImageNet folder (the one "
                        "holding train/ and val/): --set data.root=/path/to/imagenet (docs/imagenet.md).")
    classes, train_paths, train_labels = scan(root, "train")
    if cfg.val_split is None:
        _, val_paths, val_labels = scan(root, "val", classes, cfg.val_labels)
    else:   # the held-out training images are the evaluation set: val/ is not read, and need not exist
        val_paths, val_labels = np.array([], dtype=str), torch.empty(0, dtype=torch.int64)
    from largebatch.data.gpu_jpeg import check_decode

    common = dict(size=cfg.image_size, min_scale=cfg.min_scale, seed=seed, workers=cfg.loader_workers,
                  on_corrupt=cfg.on_corrupt, gpu=check_decode(cfg.decode, cfg.dataset), gpu_decoder=cfg.gpu_decoder)
    train_cache, test_cache = split_cache(cfg.gpu_cache_gb, len(train_paths), len(val_paths))
    train = ImageFolderSource(train_paths, train_labels, augment=cfg.augment, gpu_cache_gb=train_cache, **common)
    test = ImageFolderSource(val_paths, val_labels, augment=False, gpu_cache_gb=test_cache, **common)
    info = DatasetInfo(len(classes), 3, cfg.image_size, IMAGENET_MEAN, IMAGENET_STD, len(train), len(test),
                       f"imagefolder:{root.name}", tuple(classes))
    return train, test, info
