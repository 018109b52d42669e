"""Tar shards: pack an ImageFolder, read exactly once across 2 ranks x 2 loader workers."""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from largebatch.config import DataConfig
from largebatch.data import build_data
from largebatch.data.sampler import eval_shard, steps_per_epoch
from largebatch.data.shards import ShardSource, slot_ranges
from largebatch.errors import UserError

pytestmark = pytest.mark.timeout(240)


def _tree(root: Path, train: int = 37, val: int = 11) -> None:
    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("val", val)):
        for i in range(count):
            folder = root / split / f"c{i % 3}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (24, 30, 3), dtype=np.uint8)).save(folder / f"{i}.jpg", quality=80)


def test_slot_ranges_partition_uneven_shards():
    counts = [5, 1, 9, 3, 7]  # uneven, fewer shards than 3 ranks x 2 workers
    order = [2, 0, 4, 1, 3]
    seen = []
    for rank in range(3):
        per_rank = 0
        for pieces in slot_ranges(counts, order, rank, 3, 2):
            for shard, a, b in pieces:
                seen += [(shard, j) for j in range(a, b)]
                per_rank += b - a
        assert per_rank == len(eval_shard(sum(counts), rank, 3))
    assert sorted(seen) == sorted((s, j) for s, c in enumerate(counts) for j in range(c))


def test_pack_and_read_exactly_once_two_ranks_two_workers(tmp_path, cli):
    _tree(tmp_path / "if")
    proc = cli("data", "pack", tmp_path / "if", tmp_path / "sh", "--shard-size-mb", "0.004")
    assert proc.returncode == 0, proc.stderr
    index = json.loads((tmp_path / "sh" / "index.json").read_text())
    shards = index["splits"]["train"]["shards"]
    assert len(shards) >= 4 and sum(s["count"] for s in shards) == 37
    with tarfile.open(tmp_path / "sh" / shards[0]["name"]) as tar:
        names = tar.getnames()
    assert names[0].endswith(".jpg") and names[1] == names[0][:-4] + ".cls"
    # Pack order is shuffled (not class-sorted).
    labels = [int(tarfile.open(tmp_path / "sh" / s["name"]).extractfile(m).read())
              for s in shards for m in tarfile.open(tmp_path / "sh" / s["name"]) if m.name.endswith(".cls")]
    assert labels != sorted(labels) and sorted(labels) == sorted([i % 3 for i in range(37)])

    def source(split: str, rank: int) -> ShardSource:
        return ShardSource(tmp_path / "sh", index["splits"][split], size=16, min_scale=0.3, seed=1, augment=True,
                           workers=2, on_corrupt="fail", rank=rank, world=2)

    # Evaluation: the whole val split exactly once across the 2 ranks, in the trainer's batch sizes.
    val_keys = []
    for rank in range(2):
        src = source("val", rank)
        idx = eval_shard(len(src), rank, 2)
        got = [(x.shape, len(y)) for x, y in src.batches(list(idx.split(4)), train=False, epoch=0)]
        assert sum(n for _, n in got) == len(idx) and all(s[1:] == (3, 16, 16) for s, _ in got)
        val_keys += torch.cat(src.last_keys).tolist()
    assert sorted(val_keys) == list(range(11))
    # Training epoch: each rank runs the same number of steps; keys disjoint, never repeated.
    gb = 8
    steps = steps_per_epoch(37, gb)
    for epoch in (0, 1):
        keys = []
        for rank in range(2):
            src = source("train", rank)
            out = list(src.batches([torch.zeros(gb // 2)] * steps, train=True, epoch=epoch))
            assert [len(y) for _, y in out] == [gb // 2] * steps
            keys += torch.cat(src.last_keys).tolist()
        assert len(keys) == steps * gb and len(set(keys)) == len(keys) and max(keys) < 37
        if epoch == 0:
            first = keys
    assert keys != first  # a new shard permutation and shuffle every epoch


def test_shards_build_data_errors(tmp_path):
    from largebatch.data import shards

    with pytest.raises(UserError, match="largebatch data pack"):
        build_data(DataConfig(dataset="shards", root=str(tmp_path)), seed=0)
    # In-process (the CLI turns UserError into exit 2; the pack test above runs the real CLI).
    with pytest.raises(UserError):
        shards.main([str(tmp_path / "missing"), str(tmp_path / "out")])
