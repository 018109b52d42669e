"""ImageFolder source on a small JPEG tree written here with Pillow (real JPEG encoding)."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from largebatch.config import DataConfig
from largebatch.data import build_data
from largebatch.errors import UserError

pytestmark = pytest.mark.timeout(180)


def _jpeg(path: Path, array: np.ndarray, mode: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(array)
    if mode:
        img = img.convert(mode)
    img.save(path, "JPEG", quality=95)


def _tree(root: Path, per_class: int = 4, size=(60, 40)) -> None:
    """3 classes; class k images are a flat colour k so labels can be checked from pixels."""
    colours = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]
    for split in ("train", "val"):
        for k, colour in enumerate(colours):
            for i in range(per_class):
                arr = np.empty((size[1], size[0], 3), np.uint8)
                arr[:] = colour
                _jpeg(root / split / f"c{k}" / f"{i}.jpg", arr)


def _cfg(root: Path, **kw) -> DataConfig:
    return DataConfig(**{"dataset": "imagefolder", "root": str(root), "image_size": 32, "loader_workers": 0, **kw})


def test_shapes_labels_and_eval_center_crop(tmp_path):
    _tree(tmp_path)
    # One val image with a known pattern: left half black, right half white, 100 x 50.
    arr = np.zeros((50, 100, 3), np.uint8)
    arr[:, 50:] = 255
    _jpeg(tmp_path / "val" / "c0" / "zz.jpg", arr)
    train, test, info = build_data(_cfg(tmp_path), seed=0)
    assert info.num_classes == 3 and info.in_channels == 3 and (len(train), len(test)) == (12, 13)
    x, y = next(train.batches([torch.arange(12)], train=True, epoch=0))
    assert x.shape == (12, 3, 32, 32) and x.dtype == torch.uint8
    assert y.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    dominant = x.float().mean(dim=(2, 3)).argmax(1)  # flat colours survive crop/resize
    assert torch.equal(dominant, y)
    xe, ye = next(test.batches([torch.tensor([4])], train=False, epoch=0))  # zz.jpg sorts last in c0
    assert ye.tolist() == [0]
    # Eval: shorter side 50 -> round(32/0.875) = 37, centre 32 x 32 of 74 x 37: the crop spans
    # the middle 43 px of the original, so the black/white edge is in the middle column.
    row = xe[0, 0, 16].float()
    assert row[:12].max() < 40 and row[-12:].min() > 215
    assert 10 <= int((row > 128).sum()) <= 22
    # Evaluation is deterministic and ignores the epoch.
    xe2, _ = next(test.batches([torch.tensor([4])], train=False, epoch=9))
    assert torch.equal(xe, xe2)


def test_same_batches_with_any_worker_count(tmp_path):
    rng = np.random.default_rng(0)
    for k in range(2):
        for i in range(6):
            _jpeg(tmp_path / "train" / f"c{k}" / f"{i}.jpg", rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
            _jpeg(tmp_path / "val" / f"c{k}" / f"{i}.jpg", rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
    index = [torch.tensor([3, 1, 7]), torch.tensor([11, 0]), torch.tensor([5, 6, 2, 9])]
    outs = []
    for workers in (0, 2):
        train, _, _ = build_data(_cfg(tmp_path, loader_workers=workers), seed=4)
        outs.append([(x.clone(), y) for x, y in train.batches(index, train=True, epoch=2)])
        again = [x.clone() for x, _ in train.batches(index, train=True, epoch=2)]  # persistent workers reused
        assert all(torch.equal(a, b[0]) for a, b in zip(again, outs[-1]))
    for (x0, y0), (x2, y2) in zip(*outs):
        assert torch.equal(x0, x2) and torch.equal(y0, y2)
    train, _, _ = build_data(_cfg(tmp_path), seed=4)
    x3 = next(train.batches(index, train=True, epoch=3))[0]
    assert not torch.equal(x3, outs[0][0][0])  # a new epoch, new crops


def test_corrupt_truncated_grayscale_cmyk(tmp_path):
    _tree(tmp_path, per_class=2)
    rng = np.random.default_rng(1)
    good = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(good, "JPEG")
    (tmp_path / "train" / "c0" / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    (tmp_path / "train" / "c1" / "trunc.jpg").write_bytes(good.getvalue()[: len(good.getvalue()) // 2])
    _jpeg(tmp_path / "train" / "c2" / "gray.jpg", rng.integers(0, 256, (40, 60), dtype=np.uint8))
    _jpeg(tmp_path / "train" / "c2" / "x_cmyk.jpg", rng.integers(0, 256, (40, 60, 3), dtype=np.uint8), mode="CMYK")
    train, _, _ = build_data(_cfg(tmp_path, loader_workers=1), seed=0)
    assert len(train) == 10
    x, y = next(train.batches([torch.arange(10)], train=True, epoch=0))
    assert x.shape == (8, 3, 32, 32)  # two skipped, grayscale and CMYK decoded as RGB
    assert sorted(Path(p).name for p in train.corrupt) == ["bad.jpg", "trunc.jpg"]
    assert y.tolist() == [0, 0, 1, 1, 2, 2, 2, 2]
    fail, _, _ = build_data(_cfg(tmp_path, on_corrupt="fail"), seed=0)
    with pytest.raises(UserError, match="bad.jpg"):
        list(fail.batches([torch.arange(10)], train=True, epoch=0))


def test_missing_or_empty_splits(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        build_data(_cfg(tmp_path / "nope"), seed=0)
    (tmp_path / "train").mkdir()
    with pytest.raises(UserError, match="train has no images"):
        build_data(_cfg(tmp_path), seed=0)
    (tmp_path / "train" / "a").mkdir()
    with pytest.raises(UserError, match=r"class folder .*train/a has no images"):   # an empty class
        build_data(_cfg(tmp_path), seed=0)
    _jpeg(tmp_path / "train" / "a" / "0.jpg", np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(UserError, match=r"has 1 class folder\(s\); a classifier needs 2 or more"):
        build_data(_cfg(tmp_path), seed=0)
    (tmp_path / "train" / "b").mkdir()
    _jpeg(tmp_path / "train" / "b" / "0.jpg", np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(UserError, match="val is missing"):
        build_data(_cfg(tmp_path), seed=0)
    (tmp_path / "val" / "a").mkdir(parents=True)
    with pytest.raises(UserError, match="val has no images"):
        build_data(_cfg(tmp_path), seed=0)
