"""Sequential tar shards (WebDataset layout) for multi-node streaming: the reader.

`largebatch data pack SRC_IMAGEFOLDER DST_DIR [--shard-size-mb 64]` (largebatch/data/pack.py) writes
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

Damaged shards (exactly once, or a sentence naming the shard):

6. Start-up, O(shards) per rank: ``check_index`` checks index.json's fields and ``check_split`` each shard
   against the fingerprint ``data pack`` recorded beside its count, walking (tar headers and labels, no image
   decoded) only a shard that fails it; a damaged shard is one UserError naming it, before training
   (largebatch/data/shard_check.py, where the rules and their costs are written out).
7. Reading: the workers apply the same rules as the walk to every member they pass (headers of every member of
   their pieces, the label and image of each sample they keep) and also stop at a shard that ends before its
   piece does or holds more samples than listed (one changed since start-up, or damage that step 6 cannot see);
   the sentence travels to the main process as data and is raised there (exit 2). The main process also
   counts: evaluation must see (decoded + corrupt) = its range, and training must fill every step it was asked
   for.
8. Images: a JPEG that does not decode follows ``data.on_corrupt`` (skip and list it as
   ``<shard>/<key>.jpg``, or stop); in training, skipping so many that a rank cannot fill
   its steps is a UserError too.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from largebatch.data import jpeg, keyed_random
from largebatch.data.sampler import eval_shard, epoch_permutation
from largebatch.data.shard_check import check_index, check_split, read_label, samples_in
from largebatch.data.tar import FIX, INDEX, open_shard, read_member
from largebatch.errors import UserError, shown

_CHUNK = 16  # samples per worker -> main process message


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


def _read_pieces(root: Path, names: list[str], counts: list[int], pieces: list[tuple[int, int, int]],
                 num_classes: int) -> Iterator[tuple[str, int, bytes, int]]:
    """Step 3: (shard name, key, jpeg bytes, label) of each piece, sequentially, skipping by seek.

    A shard that ends before the piece does, holds more samples than listed, or is damaged in any other way, is
    a UserError naming it: a sample is never dropped silently (check_split refuses such a shard at start-up;
    this catches one that changed since, and damage inside a shard that its fingerprint does not cover).
    """
    for shard, first, stop in pieces:
        path = root / names[shard]
        tar, size = open_shard(path)
        sample = -1
        with tar:
            for key, group in samples_in(tar, shown(path), size):
                sample += 1
                if sample >= stop:
                    if stop == counts[shard]:
                        raise UserError(f"shard {shown(path)} holds more than the {counts[shard]} samples {INDEX} "
                                        f"lists (it changed since it was packed, or {INDEX} is wrong); {FIX}.")
                    break
                if sample < first:
                    continue  # skipped by seek: tarfile does not read data we do not extract
                label = read_label(tar, shown(path), group["cls"], num_classes)
                yield names[shard], key, read_member(tar, shown(path), group["jpg"]), label
        if sample + 1 < stop:
            raise UserError(f"shard {shown(path)} holds {sample + 1} samples but {INDEX} lists {counts[shard]} "
                            f"(it is truncated or {INDEX} is wrong); {FIX}.")


class ShardStream(IterableDataset):
    """Steps 3-4 inside one loader worker."""

    def __init__(self, root: Path, names: list[str], counts: list[int], *, num_classes: int, size: int,
                 min_scale: float, seed: int, buffer: int, rank: int, world: int, workers: int) -> None:
        self.root, self.names, self.counts, self.num_classes = root, names, counts, num_classes
        self.size, self.min_scale, self.seed, self.buffer = size, min_scale, seed, buffer
        self.rank, self.world, self.workers = rank, world, workers
        self.epoch, self.train, self.augment = 0, False, False

    def set_epoch(self, epoch: int, train: bool, augment: bool) -> None:
        """Read by the workers, which start (fork) after this call: no state is sent later."""
        self.epoch, self.train, self.augment = epoch, train, augment

    def _read(self, pieces: list[tuple[int, int, int]]) -> Iterator[tuple[str, int, bytes, int]]:
        """(name to list the image by if it is corrupt, key, image bytes, label) of each sample of `pieces`: the
        one part a reader of another shard layout replaces (largebatch/data/wds.py)."""
        for shard, key, data, label in _read_pieces(self.root, self.names, self.counts, pieces, self.num_classes):
            yield f"{shard}/{key:09d}.jpg", key, data, label

    def _samples(self) -> Iterator[tuple[str, int, bytes, int]]:
        info = get_worker_info()
        worker = info.id if info else 0
        if self.train:
            order = epoch_permutation(len(self.counts), self.epoch, self.seed).tolist()
        else:
            order = list(range(len(self.counts)))
        pieces = slot_ranges(self.counts, order, self.rank, self.world, self.workers)[worker]
        stream = self._read(pieces)
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
        """Chunks (x, labels, keys, corrupt names, damage): damage is "" or the sentence naming a damaged shard,
        sent as data and raised by the main process (an exception in a loader worker would reach the user as
        a traceback of the worker)."""
        out = torch.empty((_CHUNK, self.size, self.size, 3), dtype=torch.uint8)
        labels, corrupt, keys = [], [], []
        damage = ""
        try:
            for member, key, data, label in self._samples():
                try:
                    jpeg.decode_crop(data, self.size, train=self.augment, min_scale=self.min_scale, seed=self.seed,
                                     epoch=self.epoch, index=key, out=out[len(labels)])
                except jpeg.CorruptImage:
                    corrupt.append(member)
                    continue
                labels.append(label)
                keys.append(key)
                if len(labels) == _CHUNK:
                    yield out.permute(0, 3, 1, 2), torch.tensor(labels), torch.tensor(keys), corrupt, ""
                    out = torch.empty_like(out)
                    labels, corrupt, keys = [], [], []
        except UserError as err:
            damage = str(err)
        yield out[:len(labels)].permute(0, 3, 1, 2), torch.tensor(labels, dtype=torch.int64), \
            torch.tensor(keys, dtype=torch.int64), corrupt, damage


class ShardSource:
    """A split of a shard directory, read by this rank's loader workers."""

    def __init__(self, root: Path, split: dict, *, num_classes: int, size: int, min_scale: float, seed: int,
                 augment: bool, workers: int, on_corrupt: str, rank: int, world: int, buffer: int = 512,
                 stream: type[ShardStream] | None = None, repair: str = FIX) -> None:
        """`stream`: the worker-side reader (another shard layout's, e.g. wds.WdsStream); `repair`: the fix its
        sentences name."""
        names = [s["name"] for s in split["shards"]]
        counts = [int(s["count"]) for s in split["shards"]]
        self.total = int(split["total"])
        self.rank, self.world = rank, world
        self.augment, self.workers, self.on_corrupt, self.repair = augment, workers, on_corrupt, repair
        self.stream = (stream or ShardStream)(root, names, counts, num_classes=num_classes, size=size, min_scale=min_scale,
                                   seed=seed, buffer=buffer, rank=rank, world=world, workers=workers)
        self.corrupt: list[str] = []
        self.last_keys: list[torch.Tensor] = []  # keys of the samples of the last epoch (tests, audits)

    def __len__(self) -> int:
        return self.total

    def batches(self, index_batches: Iterable[torch.Tensor], *, train: bool, epoch: int
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Step 4-5: batches with the sizes of `index_batches`; eval streams the whole range.

        A stream that ends short (a damaged shard the workers named, or fewer samples than the steps need)
        is a UserError, never a silently shorter epoch or evaluation."""
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
        streamed = skipped = 0
        for x, y, k, corrupt, damage in loader:
            if damage:
                raise UserError(damage)
            streamed += len(y)
            if corrupt:
                self.corrupt += corrupt
                skipped += len(corrupt)
                if self.on_corrupt == "fail":
                    fix = "re-pack from a clean ImageFolder" if self.repair == FIX else "replace it"
                    raise UserError(f"corrupt image {corrupt[0]} in the shards; {fix}, or set data.on_corrupt=skip.")
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
        expected = len(eval_shard(self.total, self.rank, self.world))
        if streamed + skipped != expected:   # the workers name a short shard; this is the backstop
            raise UserError(f"rank {self.rank} read {streamed + skipped} of its {expected} samples of the shards "
                            f"(epoch {epoch}); a shard is shorter than its index says: {self.repair}.")
        if train:   # every sample read, yet too few for the epoch's steps: the corrupt ones were skipped
            fix = ("remove them from the ImageFolder and re-pack with 'largebatch data pack'" if self.repair == FIX
                   else "replace them in the shards")
            raise UserError(f"rank {self.rank} ran out of training samples in epoch {epoch} after skipping {skipped} "
                            f"corrupt images (data.on_corrupt=skip); {fix}.")
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
    except (OSError, ValueError) as err:   # ValueError: not JSON, or not UTF-8
        raise UserError(f"cannot read {root / INDEX} ({err}); re-run 'largebatch data pack'.") from None
    check_index(index, root)
    num_classes = len(index["classes"])
    for split in ("train", "val"):
        check_split(root, split, index["splits"][split], num_classes)
    dist = env_info()
    common = dict(num_classes=num_classes, size=cfg.image_size, min_scale=cfg.min_scale, seed=seed,
                  workers=cfg.loader_workers, on_corrupt=cfg.on_corrupt, rank=dist.rank, world=dist.world_size)
    train = ShardSource(root, index["splits"]["train"], augment=cfg.augment, **common)
    test = ShardSource(root, index["splits"]["val"], augment=False, **common)
    info = DatasetInfo(num_classes, 3, cfg.image_size, IMAGENET_MEAN, IMAGENET_STD, len(train), len(test),
                       f"shards:{root.name}")
    return train, test, info
