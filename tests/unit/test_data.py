"""Data layer: IDX reader, samplers, in-memory augmentation, synthetic source, build_data."""
from __future__ import annotations

import gzip
import struct
from dataclasses import replace

import numpy as np
import pytest
import torch

from largebatch.config import DataConfig
from largebatch.data import build_data, idx, sampler
from largebatch.data.memory import MemorySource
from largebatch.errors import UserError

FMNIST = "/usr/share/datasets/fashion-mnist"


def _idx_bytes(array: np.ndarray, code: int = 0x08) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


# ---- IDX reader -------------------------------------------------------------------------

def test_fashion_mnist_real_files():
    train, test, info = build_data(DataConfig(), seed=0)
    assert (len(train), len(test)) == (60000, 10000)
    assert info.num_classes == 10 and info.in_channels == 1 and info.image_size == 28
    assert abs(info.mean[0] - 0.286) < 0.002 and abs(info.std[0] - 0.353) < 0.002
    x, y = next(test.batches([torch.arange(10000)], train=False, epoch=0))
    assert x.shape == (10000, 1, 28, 28) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert int(y.min()) == 0 and int(y.max()) == 9
    assert torch.bincount(y).tolist() == [1000] * 10  # the test set is balanced


@pytest.mark.parametrize("compress", [False, True])
def test_idx_roundtrip_plain_and_gzip(tmp_path, compress):
    images = np.random.default_rng(0).integers(0, 256, (7, 5, 6), dtype=np.uint8)
    ints = np.arange(-3, 9, dtype=np.int32).reshape(3, 4)
    for name, arr, code in (("img", images, 0x08), ("int", ints, 0x0C)):
        raw = _idx_bytes(arr, code)
        path = tmp_path / (name + (".gz" if compress else ""))
        path.write_bytes(gzip.compress(raw) if compress else raw)
        out = idx.read_idx(path)
        assert out.shape == arr.shape
        assert np.array_equal(out.numpy(), arr)


def test_idx_errors_name_the_file(tmp_path):
    raw = _idx_bytes(np.zeros((4, 3, 3), np.uint8))
    cases = {
        "truncated": raw[:-5],
        "long": raw + b"\0",
        "magic": b"\x01\x02" + raw[2:],
        "dtype": raw[:2] + b"\x42" + raw[3:],
        "header": raw[:6],
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UserError, match=name):
            idx.read_idx(tmp_path / name)
    (tmp_path / "gz").write_bytes(gzip.compress(raw)[:-10])  # truncated gzip stream
    with pytest.raises(UserError, match="gz.*gzip"):
        idx.read_idx(tmp_path / "gz")


def test_missing_dataset_hint(tmp_path):
    with pytest.raises(UserError, match="apt-get install -y dataset-fashion-mnist"):
        build_data(DataConfig(dataset="idx", root=str(tmp_path / "nowhere")), seed=0)
    with pytest.raises(UserError, match="apt-get install -y dataset-fashion-mnist"):
        build_data(DataConfig(dataset="idx", root=str(tmp_path)), seed=0)


# ---- samplers ----------------------------------------------------------------------------

def test_eval_shard_exactly_once_uneven():
    n, world = 10007, 3
    shards = [sampler.eval_shard(n, r, world) for r in range(world)]
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n
    assert torch.equal(torch.cat(shards), torch.arange(n))  # every index once, in order
    assert [len(sampler.eval_shard(2, r, 3)) for r in range(3)] == [1, 1, 0]


def test_train_steps_disjoint_across_ranks_and_steps():
    n, gb, world = 1000, 96, 4
    perm = sampler.epoch_permutation(n, epoch=3, seed=7)
    steps = sampler.steps_per_epoch(n, gb)
    assert steps == 10
    seen = torch.cat([sampler.rank_batch(perm, s, gb, r, world) for s in range(steps) for r in range(world)])
    assert seen.numel() == steps * gb and seen.unique().numel() == seen.numel()
    assert int(seen.min()) >= 0 and int(seen.max()) < n
    with pytest.raises(UserError, match="divisible"):
        sampler.rank_batch(perm, 0, 97, 0, world)


def test_permutation_depends_on_seed_and_epoch_only():
    a = sampler.epoch_permutation(500, epoch=1, seed=0)
    assert torch.equal(a, sampler.epoch_permutation(500, epoch=1, seed=0))
    assert torch.equal(a.sort().values, torch.arange(500))
    assert not torch.equal(a, sampler.epoch_permutation(500, epoch=2, seed=0))
    assert not torch.equal(a, sampler.epoch_permutation(500, epoch=1, seed=1))
    torch.manual_seed(123)  # the global RNG state has no influence
    assert torch.equal(a, sampler.epoch_permutation(500, epoch=1, seed=0))


# ---- in-memory augmentation --------------------------------------------------------------

def _reference_crop_flip(src: MemorySource, index: torch.Tensor, epoch: int) -> torch.Tensor:
    """Per-image loop with the same offsets: what the vectorised gather must equal."""
    from largebatch.data import keyed_random

    c, h, w = src.shape
    p = src.padding
    out = []
    for i in index.tolist():
        oy = keyed_random.hash32(src.seed, epoch, i, 1) % (2 * p + 1)
        ox = keyed_random.hash32(src.seed, epoch, i, 2) % (2 * p + 1)
        img = src.padded[i, :, oy:oy + h, ox:ox + w]
        if keyed_random.hash32(src.seed, epoch, i, 3) & 1:
            img = img.flip(2)
        out.append(img)
    return torch.stack(out)


def test_batched_crop_flip_matches_per_image_reference():
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (50, 2, 9, 7), generator=gen, dtype=torch.uint8)
    src = MemorySource(images, torch.arange(50), seed=5, augment=True, padding=3)
    index = torch.tensor([3, 49, 0, 17, 17, 8])
    x, y = next(src.batches([index], train=True, epoch=2))
    assert torch.equal(x, _reference_crop_flip(src, index, 2))
    assert torch.equal(y, index)
    # Determinism: same (seed, epoch, idx) -> same pixels, whatever else is in the batch.
    x1, _ = next(src.batches([torch.tensor([17])], train=True, epoch=2))
    assert torch.equal(x1[0], x[3])
    x_other, _ = next(src.batches([index], train=True, epoch=3))
    assert not torch.equal(x_other, x)
    # Evaluation: the original images.
    xe, _ = next(src.batches([index], train=False, epoch=2))
    assert torch.equal(xe, images[index])
    # Both flips and several offsets occur.
    many = torch.arange(50)
    xa, _ = next(src.batches([many], train=True, epoch=0))
    assert (xa != images).any(dim=(1, 2, 3)).float().mean() > 0.5


def test_large_images_copied_per_window_equal_the_gather(monkeypatch):
    from largebatch.data import keyed_random, memory, synthetic

    # 70 x 70 px is over the window-copy area; a pool of 7 images for 40 exercises _storage
    monkeypatch.setattr(synthetic, "POOL_BYTES", 7 * 3 * 70 * 70)
    src = synthetic.SyntheticSource(40, 10, 70, seed=4, augment=True, padding=4)
    assert src.pool == 7 and 70 * 70 >= memory.WINDOW_COPY_PIXELS
    index = torch.tensor([0, 39, 7, 13, 13, 22, 5, 30, 31, 32])
    windows = src.crop_flip(index, 1)
    monkeypatch.setattr(memory, "WINDOW_COPY_PIXELS", 10**9)   # the per-pixel gather instead
    gathered = src.crop_flip(index, 1)
    assert windows.shape == (10, 3, 70, 70) and windows.dtype == torch.uint8
    assert torch.equal(windows, gathered)
    flips = [bool(keyed_random.hash32(src.seed, 1, i, 3) & 1) for i in index.tolist()]
    assert any(flips) and not all(flips)   # both branches of the copy ran


def test_synthetic_source_fixed_per_seed():
    cfg = DataConfig(dataset="synthetic", image_size=16, num_classes=7, synthetic_size=300)
    a, at, info = build_data(cfg, seed=3)
    b, _, _ = build_data(cfg, seed=3)
    c, _, _ = build_data(cfg, seed=4)
    assert info.in_channels == 3 and info.num_classes == 7 and len(a) == 300 and len(at) == 37
    idx_ = [torch.arange(0, 300, 7)]
    xa, ya = next(a.batches(idx_, train=True, epoch=1))
    xb, yb = next(b.batches(idx_, train=True, epoch=1))
    xc, _ = next(c.batches(idx_, train=True, epoch=1))
    assert xa.shape == (43, 3, 16, 16) and torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(xa, xc) and int(ya.max()) < 7


def test_bad_options_are_user_errors():
    with pytest.raises(UserError, match="crop_padding"):
        build_data(replace(DataConfig(), crop_padding=-1), seed=0)
    with pytest.raises(UserError, match="min_scale"):
        build_data(replace(DataConfig(), min_scale=0.0), seed=0)


def _pixels_and_labels(source, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*source.batches([torch.arange(n)], train=False, epoch=0))
    return torch.cat(xs), torch.cat(ys)


def test_validation_split_is_disjoint_exact_and_the_same_for_every_seed():
    cfg = DataConfig(dataset="synthetic", synthetic_size=300, image_size=8, num_classes=4, val_split=50)
    full, _, _ = build_data(replace(cfg, val_split=None), seed=0)
    parts = {}
    for seed in (0, 1):
        train, val, info = build_data(cfg, seed=seed)
        assert (len(train), len(val), info.train_size, info.test_size) == (250, 50, 250, 50)
        assert info.name.endswith("+val50")
        assert not set(train.keep.tolist()) & set(val.keep.tolist())                  # disjoint
        assert sorted(train.keep.tolist() + val.keep.tolist()) == list(range(300))    # together: all of them
        parts[seed] = (train.keep.clone(), val.keep.clone())
    assert torch.equal(parts[0][1], parts[1][1]) and torch.equal(parts[0][0], parts[1][0])   # fixed split
    train, val, _ = build_data(cfg, seed=0)
    x_val, y_val = _pixels_and_labels(val, 50)
    x_full, y_full = _pixels_and_labels(full, 300)
    assert torch.equal(x_val, x_full[val.keep]) and torch.equal(y_val, y_full[val.keep])   # the held-out images
    sub = build_data(replace(cfg, subset=100), seed=0)[0]                 # data.subset draws from the rest only
    assert len(sub) == 100 and set(train.keep[sub.keep].tolist()) <= set(train.keep.tolist())
    for bad in (0, 300):
        with pytest.raises(UserError, match="data.val_split"):
            build_data(replace(cfg, val_split=bad), seed=0)


def test_a_run_with_a_validation_split_evaluates_on_it(tmp_path, one_thread):
    from largebatch.config import from_dict
    from largebatch.trainer import Trainer

    cfg = from_dict({"model": {"width": 4}, "data": {"dataset": "synthetic", "synthetic_size": 160, "image_size": 8,
                                                     "val_split": 32},
                     "batch": {"global_batch": 32}, "schedule": {"epochs": 1, "warmup_epochs": 0},
                     "train": {"plots": False}})
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    summary = trainer.fit()
    assert summary["steps"] == 4                       # 128 training images / 32
    assert trainer.last_eval["count"] == 32            # every evaluation on the 32 held-out images
