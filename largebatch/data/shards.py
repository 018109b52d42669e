"""Sequential tar shards (WebDataset layout) for multi-node streaming.

`largebatch data pack SRC_IMAGEFOLDER DST_DIR [--shard-size-mb 64]` writes
``train-000000.tar ...`` and ``val-000000.tar ...``, each member pair
``<key>.jpg`` + ``<key>.cls`` (the label as ASCII), samples in a seeded shuffled
order, plus ``index.json`` (classes, and per split the shards with their sample
counts). ``key`` is the sample's position in its split (``%09d``), which is also the
image index that keys its augmentation.

How an epoch reads the shards, exactly once:

1. Order: the split's shards in a permutation seeded by ``(seed, epoch)`` (training),
   or in pack order (evaluation). Concatenated, they are one sequence of the ``n``
   samples of the split.
2. Ranks: rank ``r`` takes the contiguous range ``eval_shard(n, r, world)`` of that
   sequence; ranges partition ``0..n-1``, so every sample belongs to exactly one rank
   and ranks differ by at most one sample. In evaluation this is exactly the range
   of indices the trainer asks each rank for.
3. Workers: the rank's range is split the same way over its loader workers.
   A worker reads whole shards sequentially; only the first and last shard of its
   range can be partial (members before the range are skipped by seeking over tar
   headers, never decoded).
4. Shuffle: each worker passes its samples through a shuffle buffer (``buffer``
   samples, seeded by ``(seed, epoch, rank, worker)``), decodes them with
   ``jpeg.decode_crop`` and yields chunks; the main process re-cuts the stream into
   batches of the sizes the trainer's index batches have (only their sizes are used).
5. End of epoch: training stops after the trainer's ``n // global_batch`` steps; each
   rank holds ``>= floor(n / world)`` samples, which is at least what those steps
   need, so the rest of the stream (the tail, < one global batch plus at most one
   sample per rank) is not read: at most once in training, as for the other sources.
   Evaluation streams the whole range: exactly once.

Uneven shards: whole-shard assignment (WebDataset's ``split_by_node``) gives ranks
counts that differ by up to a shard, so ranks would run different step counts (a
hang under DDP) or drop data. Step 2 splits at sample granularity instead, so any
shard sizes and any number of shards (even fewer than ranks x workers) work.
The order of samples within a rank depends on the number of loader workers
(the pixels of a given sample do not: they are keyed by its index).
"""
from __future__ import annotations

import io
import json
import math
import os
import random
import tarfile
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from largebatch.cli import ArgumentParser, check_numbers
from largebatch.data import jpeg, keyed_random
from largebatch.data.sampler import eval_shard, epoch_permutation
from largebatch.errors import UserError, os_error_fix

INDEX = "index.json"
_CHUNK = 16  # samples per worker -> main process message


# ---- packing -----------------------------------------------------------------------------

def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def pack(src: Path, dst: Path, shard_bytes: int, seed: int = 0) -> dict:
    """Write the shards and index.json into `dst`, which must not exist or be empty; returns the index.

    Everything is written into a temporary sibling directory first and renamed into place at the end, so
    an existing shard set is never touched and a failure (a full disk, Ctrl-C) leaves no half-written set
    where training would read it.
    """
    import shutil

    from largebatch.data.imagefolder import scan

    if dst.exists() and not dst.is_dir():
        raise UserError(f"data pack destination {dst} is a file; give a new or empty directory.")
    if dst.is_dir() and any(dst.iterdir()):
        raise UserError(f"data pack destination {dst} is not empty; give a new or empty directory (an existing "
                        "shard set is never overwritten: move it away first).")
    for split in ("train", "val"):   # the shards would become a class folder of the ImageFolder they come from
        if dst.resolve().is_relative_to((src / split).resolve()):
            raise UserError(f"data pack destination {dst} is inside the source's {split}/ split {src / split}; "
                            "give a destination outside train/ and val/ (the source is never written into).")
    classes, train_paths, train_labels = scan(src, "train")
    _, val_paths, val_labels = scan(src, "val", classes)
    tmp = dst.parent / f".{dst.name}.packing-{os.getpid()}"
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        index = _write_shards(tmp, classes, (("train", train_paths, train_labels), ("val", val_paths, val_labels)),
                              shard_bytes, seed)
        if dst.is_dir():
            dst.rmdir()   # empty (checked above)
        os.rename(tmp, dst)
    except OSError as exc:
        fix = os_error_fix(exc, "free space or give another destination")
        raise UserError(f"data pack could not write {dst}: {exc.strerror or exc}; {fix} (nothing was written there).") \
            from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return index


def _write_shards(out: Path, classes: list[str], splits, shard_bytes: int, seed: int) -> dict:
    index: dict = {"format": "largebatch-shards-1", "classes": classes, "splits": {}}
    for split, paths, labels in splits:
        order = torch.randperm(len(paths), generator=torch.Generator().manual_seed(seed)).tolist()
        shards: list[dict] = []
        tar, size = None, 0
        for key, i in enumerate(order):
            data = Path(str(paths[i])).read_bytes()
            if tar is None or (size + len(data) > shard_bytes and shards[-1]["count"] > 0):
                if tar is not None:
                    tar.close()
                name = f"{split}-{len(shards):06d}.tar"
                tar, size = tarfile.open(out / name, "w", format=tarfile.USTAR_FORMAT), 0
                shards.append({"name": name, "count": 0})
            _add(tar, f"{key:09d}.jpg", data)
            _add(tar, f"{key:09d}.cls", str(int(labels[i])).encode())
            size += len(data) + 1536  # data + two headers, roughly
            shards[-1]["count"] += 1
        if tar is not None:
            tar.close()
        index["splits"][split] = {"total": len(order), "shards": shards}
    with open(out / INDEX, "w") as f:
        f.write(json.dumps(index, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return index


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="largebatch data pack", description="pack an ImageFolder into sequential tar shards")
    p.add_argument("src", type=Path, help="ImageFolder root with train/ and val/")
    p.add_argument("dst", type=Path, help="output directory for the shards and index.json")
    p.add_argument("--shard-size-mb", type=float, default=64.0, help="target shard size in MB")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled pack order")
    args = p.parse_args(argv)
    check_numbers(("--shard-size-mb", args.shard_size_mb, 2**-20 <= args.shard_size_mb < math.inf,
                   "a size in MB of at least one byte (2**-20 MB), e.g. 64"),
                  ("--seed", args.seed, -2**63 <= args.seed < 2**64, "a 64-bit integer"))
    if not args.src.is_dir():   # named as the argument it is (the ImageFolder reader names its config key data.root)
        what = "is a file, not a directory" if args.src.exists() else "does not exist"
        raise UserError(f"data pack source {args.src} {what}; give an ImageFolder root with train/ and val/.")
    index = pack(args.src, args.dst, int(args.shard_size_mb * 2**20), args.seed)
    for split, s in index["splits"].items():
        print(f"{split}: {s['total']} images in {len(s['shards'])} shards -> {args.dst}")
    return 0


# ---- reading -----------------------------------------------------------------------------

def slot_ranges(counts: list[int], order: list[int], rank: int, world: int, workers: int
                ) -> list[list[tuple[int, int, int]]]:
    """Steps 1-3: per worker of `rank`, the (shard, first, stop) pieces it reads, in order."""
    n = sum(counts)
    rank_range = eval_shard(n, rank, world)
    r0 = int(rank_range[0]) if len(rank_range) else 0
    out = []
    for w in range(max(1, workers)):
        sub = eval_shard(len(rank_range), w, max(1, workers))
        lo = r0 + (int(sub[0]) if len(sub) else 0)
        hi = lo + len(sub)
        pieces, start = [], 0
        for shard in order:
            end = start + counts[shard]
            a, b = max(lo, start), min(hi, end)
            if a < b:
                pieces.append((shard, a - start, b - start))
            start = end
        out.append(pieces)
    return out


def _read_pieces(root: Path, names: list[str], pieces: list[tuple[int, int, int]]) -> Iterator[tuple[int, bytes, int]]:
    """Step 3: (key, jpeg bytes, label) of each piece, sequentially, skipping by seek."""
    for shard, first, stop in pieces:
        with tarfile.open(root / names[shard], "r:") as tar:
            sample, jpg, key = -1, None, None
            for member in tar:
                stem, _, ext = member.name.partition(".")
                if stem != key:
                    key, sample = stem, sample + 1
                    if sample >= stop:
                        break
                if sample < first:
                    continue  # skipped by seek: tarfile does not read data we do not extract
                f = tar.extractfile(member)
                assert f is not None, f"{member.name}: not a regular file (pack writes only files)"
                data = f.read()
                if ext == "jpg":
                    jpg = data
                elif ext == "cls":
                    yield int(key), jpg if jpg is not None else b"", int(data)
                    jpg = None


class _ShardStream(IterableDataset):
    """Steps 3-4 inside one loader worker."""

    def __init__(self, root: Path, names: list[str], counts: list[int], *, size: int, min_scale: float,
                 seed: int, buffer: int, rank: int, world: int, workers: int) -> None:
        self.root, self.names, self.counts = root, names, counts
        self.size, self.min_scale, self.seed, self.buffer = size, min_scale, seed, buffer
        self.rank, self.world, self.workers = rank, world, workers
        self.epoch, self.train, self.augment = 0, False, False

    def set_epoch(self, epoch: int, train: bool, augment: bool) -> None:
        """Read by the workers, which start (fork) after this call: no state is sent later."""
        self.epoch, self.train, self.augment = epoch, train, augment

    def _samples(self) -> Iterator[tuple[int, bytes, int]]:
        info = get_worker_info()
        worker = info.id if info else 0
        if self.train:
            order = epoch_permutation(len(self.counts), self.epoch, self.seed).tolist()
        else:
            order = list(range(len(self.counts)))
        pieces = slot_ranges(self.counts, order, self.rank, self.world, self.workers)[worker]
        stream = _read_pieces(self.root, self.names, pieces)
        if not self.train or self.buffer <= 1:
            yield from stream
            return
        rng = random.Random(keyed_random.hash32(self.seed, self.epoch, self.rank * 4096 + worker, 99))
        buf: list = []
        for item in stream:
            buf.append(item)
            if len(buf) >= self.buffer:
                j = rng.randrange(len(buf))
                buf[j], buf[-1] = buf[-1], buf[j]
                yield buf.pop()
        rng.shuffle(buf)
        yield from buf

    def __iter__(self):
        out = torch.empty((_CHUNK, self.size, self.size, 3), dtype=torch.uint8)
        labels, corrupt, keys = [], [], []
        for key, data, label in self._samples():
            try:
                jpeg.decode_crop(data, self.size, train=self.augment, min_scale=self.min_scale, seed=self.seed,
                                 epoch=self.epoch, index=key, out=out[len(labels)])
            except jpeg.CorruptImage:
                corrupt.append(f"{key:09d}.jpg")
                continue
            labels.append(label)
            keys.append(key)
            if len(labels) == _CHUNK:
                yield out.permute(0, 3, 1, 2), torch.tensor(labels), torch.tensor(keys), corrupt
                out = torch.empty_like(out)
                labels, corrupt, keys = [], [], []
        yield out[:len(labels)].permute(0, 3, 1, 2), torch.tensor(labels, dtype=torch.int64), \
            torch.tensor(keys, dtype=torch.int64), corrupt


class ShardSource:
    """A split of a shard directory, read by this rank's loader workers."""

    def __init__(self, root: Path, split: dict, *, size: int, min_scale: float, seed: int, augment: bool,
                 workers: int, on_corrupt: str, rank: int, world: int, buffer: int = 512) -> None:
        names = [s["name"] for s in split["shards"]]
        counts = [int(s["count"]) for s in split["shards"]]
        self.total = int(split["total"])
        self.augment, self.workers, self.on_corrupt = augment, workers, on_corrupt
        self.stream = _ShardStream(root, names, counts, size=size, min_scale=min_scale, seed=seed, buffer=buffer,
                                   rank=rank, world=world, workers=workers)
        self.corrupt: list[str] = []
        self.last_keys: list[torch.Tensor] = []  # keys of the samples of the last epoch (tests, audits)

    def __len__(self) -> int:
        return self.total

    def batches(self, index_batches: Iterable[torch.Tensor], *, train: bool, epoch: int
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Step 4-5: batches with the sizes of `index_batches`; eval streams the whole range."""
        self.stream.set_epoch(epoch, bool(train), bool(train and self.augment))
        loader = DataLoader(self.stream, batch_size=None, num_workers=self.workers,
                            pin_memory=torch.cuda.is_available())
        self.last_keys = []
        xs: list[torch.Tensor] = []
        ys: list[torch.Tensor] = []
        ks: list[torch.Tensor] = []
        have = 0
        sizes = iter(index_batches)
        want = None
        last = 1
        for x, y, k, corrupt in loader:
            if corrupt:
                self.corrupt += corrupt
                if self.on_corrupt == "fail":
                    raise UserError(f"corrupt image {corrupt[0]} in the shards; re-pack from a clean ImageFolder, "
                                    f"or set data.on_corrupt=skip.")
            xs.append(x)
            ys.append(y)
            ks.append(k)
            have += len(y)
            while True:
                if want is None:
                    nxt = next(sizes, None)
                    if nxt is None:
                        if train:
                            return
                        want = last
                    else:
                        want = last = max(1, len(nxt))
                if have < want:
                    break
                yield self._cut(xs, ys, ks, want)
                have -= want
                want = None
        if have:
            yield self._cut(xs, ys, ks, have)

    def _cut(self, xs: list, ys: list, ks: list, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, k = torch.cat(xs), torch.cat(ys), torch.cat(ks)
        xs[:] = [x[n:]]
        ys[:] = [y[n:]]
        ks[:] = [k[n:]]
        self.last_keys.append(k[:n])
        return x[:n], y[:n]


def build_shards(cfg, seed: int):
    from largebatch.data.info import IMAGENET_MEAN, IMAGENET_STD, DatasetInfo
    from largebatch.dist import env_info

    root = Path(cfg.root)
    if root.exists() and not root.is_dir():   # was "cannot read .../index.json ([Errno 20] ...); re-run data pack"
        raise UserError(f"data.root {root} is a file, not a directory; set data.root to the directory that "
                        "'largebatch data pack' wrote.")
    try:
        index = json.loads((root / INDEX).read_text())
    except FileNotFoundError:
        raise UserError(f"{root / INDEX} is missing; create the shards with "
                        f"'largebatch data pack IMAGEFOLDER {root}'.") from None
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {root / INDEX} ({err}); re-run 'largebatch data pack'.") from None
    for split in ("train", "val"):
        for s in index["splits"][split]["shards"]:
            if not (root / s["name"]).is_file():
                raise UserError(f"shard {root / s['name']} listed in {INDEX} is missing; copy it or re-pack.")
    dist = env_info()
    common = dict(size=cfg.image_size, min_scale=cfg.min_scale, seed=seed, workers=cfg.loader_workers,
                  on_corrupt=cfg.on_corrupt, rank=dist.rank, world=dist.world_size)
    train = ShardSource(root, index["splits"]["train"], augment=cfg.augment, **common)
    test = ShardSource(root, index["splits"]["val"], augment=False, **common)
    info = DatasetInfo(len(index["classes"]), 3, cfg.image_size, IMAGENET_MEAN, IMAGENET_STD, len(train), len(test),
                       f"shards:{root.name}")
    return train, test, info
