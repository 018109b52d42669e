"""Sequential tar shards (WebDataset layout) for multi-node streaming.

`largebatch data pack SRC_IMAGEFOLDER DST_DIR [--shard-size-mb 64]` (its command line:
largebatch/commands/data/pack.py) writes
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

6. Start-up, O(shards) per rank: ``check_index`` checks index.json's fields; ``check_split`` then checks each
   shard against the fingerprint ``data pack`` recorded beside its count in index.json: ``size`` (bytes),
   ``max_label`` and ``ends``, the SHA-256 of the count, that label, the shard's first 4 KiB and its last
   16 KiB (``fingerprint``). One open, one fstat and two small reads per shard, whatever it holds: 1,024
   ImageNet shards cost what 1,024 small files cost, where walking the 2.56 M member headers cost every rank
   22-25 s (140 s through tarfile) and a shared file system ranks x 2.56 M header reads. A shard whose
   fingerprint holds is the file ``data pack`` wrote (its size, its first and last members, the count and
   labels the index lists), so its keys are the contiguous range pack gave it (a sample's key is its position
   in the split) and nothing of it is read before the stream reads it.
   Every other shard is walked as before (``_walk_shard``): a shard of another size or other ends (cut short,
   copied wrong, appended to, re-tarred, edited), a shard listed with another count or labels beyond
   ``classes``, a missing file or one that is no regular file, and every shard of an index written before
   fingerprints (walked each start; re-pack to check in O(shards)). The walk reads the tar headers (and each
   label's few bytes; no image is decoded; directly for the plain ustar layout ``data pack`` writes, through
   tarfile for any other layout and for every damaged shard, so tarfile's reading decides): a
   file that is missing, empty or not an uncompressed tar, a member that is a
   directory, a link, an absolute or ``..`` name or anything but ``<key>.jpg`` /
   ``<key>.cls``, a member that runs past the end of the file, an image without its label
   or a label without its image, a key twice (within the shard, or in another shard's range) or outside
   ``0..total-1``, a label that is not a number in ``0..len(classes)-1``, a sample count that differs from
   index.json: each is one UserError naming the shard (and the member) and the fix, before training. A walked
   shard that holds exactly the samples listed is accepted whatever its bytes (a set re-tarred by GNU tar
   trains; it is walked at each start).
   Why not a digest of the whole file: that reads every byte (140 GB for ImageNet) on every rank. Why not
   mtime: a copy to the cluster's file system (``cp -r``, most object-store tools) changes it, so every
   start would walk again. What the fingerprint does not see, damage of the same size inside a shard (a flipped
   byte in a header or a label between its ends), is found by step 7 when the stream reads that shard.
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

import fcntl
import glob
import hashlib
import io
import json
import os
import random
import re
import stat
import tarfile
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from largebatch.data import jpeg, keyed_random
from largebatch.data.sampler import eval_shard, epoch_permutation
from largebatch.errors import UserError, os_error_fix, shown

INDEX = "index.json"
_CHUNK = 16  # samples per worker -> main process message


# ---- packing -----------------------------------------------------------------------------

def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def _skipped(src: Path, split: str, classes: list[str], taken: set[str]) -> list[str]:
    """What `imagefolder.scan` leaves out of a split (`taken`: what it read): entries of split/ that are no class
    folder (files other than a flat val/'s images, hidden folders), and under a class folder (its nested folders
    too) files that are no image of torchvision's extensions and hidden folders."""
    from largebatch.data.imagefolder import _images

    base = src / split
    out = [e.path for e in os.scandir(base)
           if (not e.is_dir() and e.path not in taken) or (e.is_dir() and e.name.startswith("."))]
    for name in classes:
        folder = base / name
        if not folder.is_dir():
            continue
        images, hidden = _images(folder)
        kept = set(images)
        for top, dirs, files in os.walk(folder, followlinks=True):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            out += [os.path.join(top, f) for f in files if os.path.join(top, f) not in kept]
        out += hidden
    return sorted(out)


def _sweep(dst: Path, say: Callable[[str], None]) -> None:
    """Remove the temporary directories of earlier packs into `dst` that were killed (SIGKILL, a power cut): each
    pack holds an flock on its temporary directory while it writes, and the kernel drops it when the pack dies,
    so a directory whose lock can be taken is nobody's."""
    import shutil

    for old in sorted(dst.parent.glob(f".{glob.escape(dst.name)}.packing-*")):
        try:
            fd = os.open(old, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:   # a file or a link of that name: not ours to remove
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:   # a pack that is writing it now
            continue
        else:
            shutil.rmtree(old)
            say(f"removed {shown(old)}, left by a data pack that was killed")
        finally:
            os.close(fd)


def pack(src: Path, dst: Path, shard_bytes: int, seed: int = 0, say: Callable[[str], None] = lambda line: None
         ) -> dict:
    """Write the shards and index.json into `dst`, which must not exist or be empty; returns the index.

    Everything is written into a temporary sibling directory first and renamed into place at the end, so
    an existing shard set is never touched and a failure (a full disk, Ctrl-C) leaves no half-written set
    where training would read it; a pack killed outright leaves its temporary directory, which the next pack
    into the same destination removes (`_sweep`). `say` gets one line per thing to report: the files of the
    ImageFolder that were left out (not images in a class folder), a removed temporary directory.
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
    for split, taken in (("train", train_paths), ("val", val_paths)):
        left_out = _skipped(src, split, classes, {str(p) for p in taken})
        if left_out:
            more = f" and {len(left_out) - 3} more" if len(left_out) > 3 else ""
            say(f"{split}: skipped {len(left_out)} entries that are not images (*.jpg, *.jpeg, *.png, ...) in a class "
                f"folder: {', '.join(shown(p) for p in left_out[:3])}{more}")
    tmp = dst.parent / f".{dst.name}.packing-{os.getpid()}"
    lock = -1
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        _sweep(dst, say)
        tmp.mkdir()
        lock = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(lock, fcntl.LOCK_EX)   # held until this process ends: see _sweep
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
        if lock >= 0:
            os.close(lock)
    return index


def _write_shards(out: Path, classes: list[str], splits, shard_bytes: int, seed: int) -> dict:
    index: dict = {"format": "largebatch-shards-1", "classes": classes, "splits": {}}
    for split, paths, labels in splits:
        order = torch.randperm(len(paths), generator=torch.Generator().manual_seed(seed)).tolist()
        shards: list[dict] = []
        tops: list[int] = []   # the largest label of each shard
        tar, size = None, 0
        for key, i in enumerate(order):
            try:
                data = Path(str(paths[i])).read_bytes()
            except OSError as exc:   # the source's fault, not the destination's
                raise UserError(f"data pack cannot read {shown(paths[i])} ({exc.strerror or exc}); fix its "
                                "permissions or remove it, then pack again (nothing was written).") from None
            if tar is None or (size + len(data) > shard_bytes and shards[-1]["count"] > 0):
                if tar is not None:
                    tar.close()
                name = f"{split}-{len(shards):06d}.tar"
                tar, size = tarfile.open(out / name, "w", format=tarfile.USTAR_FORMAT), 0
                shards.append({"name": name, "count": 0})
                tops.append(-1)
            _add(tar, f"{key:09d}.jpg", data)
            _add(tar, f"{key:09d}.cls", str(int(labels[i])).encode())
            size += len(data) + 1536  # data + two headers, roughly
            shards[-1]["count"] += 1
            tops[-1] = max(tops[-1], int(labels[i]))
        if tar is not None:
            tar.close()
        for shard, top in zip(shards, tops):   # step 6's fingerprint of each shard, as written
            shard.update(fingerprint(out / shard["name"], shard["count"], top))
        index["splits"][split] = {"total": len(order), "shards": shards}
    with open(out / INDEX, "w") as f:
        f.write(json.dumps(index, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return index



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


_MEMBER = re.compile(r"(\d{1,18})\.(jpg|cls)", re.ASCII)   # a key of ASCII digits
_FIX = "re-pack the ImageFolder with 'largebatch data pack'"


def _member_problem(member: tarfile.TarInfo, size: int) -> str | None:
    """What is wrong with one member of a shard, judged from its header alone (None: nothing)."""
    name = shown(member.name)
    if member.issym() or member.islnk():
        return f"has a link member {name} (shards hold only files)"
    if member.isdir():
        return f"has a directory member {name} (shards hold only files)"
    if not member.isreg():
        return f"has a member {name} that is not a regular file"
    if member.name.startswith("/"):
        return f"has a member with an absolute name {name}"
    if ".." in member.name.split("/"):
        return f"has a member name {name} that goes up with '..'"
    if not _MEMBER.fullmatch(member.name):
        return f"has a member {name} that is neither <key>.jpg nor <key>.cls (key: a decimal number)"
    if member.offset_data + member.size > size:
        return (f"is truncated: member {name} needs {member.offset_data + member.size} bytes, "
                f"the file has {size}")
    return None


def _members(tar: tarfile.TarFile, where: str, fix: str = _FIX) -> Iterator[tarfile.TarInfo]:
    """The members of an open shard, one header at a time; a damaged header is one sentence ending in `fix`."""
    it, count = iter(tar), 0
    while True:
        try:
            member = next(it)
        except StopIteration:
            return
        except (tarfile.TarError, ValueError) as err:   # ValueError: a header's offsets beyond a file's
            raise UserError(f"shard {where} is damaged after {count} members ({err}); {fix}.") from None
        if member.size < 0:   # base-256 size field: tarfile reads a header again (-512: forever) or fails to seek
            raise UserError(f"shard {where} has a member {shown(member.name)} with a negative size "
                            f"({member.size}); {fix}.")
        count += 1
        yield member


def _samples_in(tar: tarfile.TarFile, where: str, size: int) -> Iterator[tuple[int, dict[str, tarfile.TarInfo]]]:
    """Each sample of a shard in order: (key, {"jpg": member, "cls": member}), from the headers alone.

    A sample is the consecutive members of one key; each must be a regular file named <key>.jpg or <key>.cls
    inside the archive, lying wholly inside the file; both must be there, once each; a key comes once.
    """
    key, seen = -1, set()
    group: dict[str, tarfile.TarInfo] = {}
    for member in _members(tar, where):
        problem = _member_problem(member, size)
        if problem:
            raise UserError(f"shard {where} {problem}; {_FIX}.")
        stem, _, ext = member.name.partition(".")
        k = int(stem)
        if k != key:
            if group:
                yield key, _complete(where, key, group)
            if k in seen:
                raise UserError(f"shard {where} holds key {stem} twice (member {shown(member.name)} again after "
                                f"other keys); {_FIX}.")
            seen.add(k)
            key, group = k, {}
        if ext in group:
            raise UserError(f"shard {where} holds member {shown(member.name)} twice; {_FIX}.")
        group[ext] = member
    if group:
        yield key, _complete(where, key, group)


def _complete(where: str, key: int, group: dict[str, tarfile.TarInfo]) -> dict[str, tarfile.TarInfo]:
    if "cls" not in group:
        raise UserError(f"shard {where}: image {shown(group['jpg'].name)} has no label member "
                        f"({key:09d}.cls); {_FIX}.")
    if "jpg" not in group:
        raise UserError(f"shard {where}: label {shown(group['cls'].name)} has no image member "
                        f"({key:09d}.jpg); {_FIX}.")
    return group


def read_member(tar: tarfile.TarFile, where: str, member: tarfile.TarInfo, fix: str = _FIX) -> bytes:
    """A regular member's bytes (the callers keep only those); a tar error is one sentence naming the shard
    `where`, the member and `fix`."""
    try:
        f = tar.extractfile(member)
        assert f is not None, "a regular file (checked by the caller)"
        return f.read()
    except (OSError, tarfile.TarError) as err:
        raise UserError(f"shard {where}: cannot read member {shown(member.name)} ({err}); {fix}.") from None


def _label(tar: tarfile.TarFile, where: str, member: tarfile.TarInfo, num_classes: int) -> int:
    """The class of a <key>.cls member: a decimal number in 0..num_classes-1."""
    text = read_member(tar, where, member).strip() if member.size <= 20 else b""
    if not text.isdigit():
        what = f"{text!r}" if member.size <= 20 else f"{member.size} bytes"
        raise UserError(f"shard {where}: label member {shown(member.name)} holds {what}, not a class number; "
                        f"{_FIX}.")
    label = int(text)
    if label >= num_classes:
        raise UserError(f"shard {where}: label member {shown(member.name)} holds class {label}, outside "
                        f"0..{num_classes - 1} ({INDEX} lists {num_classes} classes); {_FIX}, or list every "
                        f"class in {INDEX}.")
    return label


def _open_shard(path: Path) -> tuple[tarfile.TarFile, int]:
    """An uncompressed tar open for reading, and its size in bytes; a file that is none is one sentence."""
    try:
        size = os.stat(path).st_size
        if size == 0:
            raise UserError(f"shard {shown(path)} is empty (0 bytes); copy it again or {_FIX}.")
        return tarfile.open(path, "r:"), size
    except FileNotFoundError:
        raise UserError(f"shard {shown(path)} listed in {INDEX} is missing; copy it or {_FIX}.") from None
    except tarfile.TarError as err:
        raise UserError(f"shard {shown(path)} is not an uncompressed tar archive ({err}); copy it again or "
                        f"{_FIX}.") from None
    except IsADirectoryError:
        raise UserError(f"shard {shown(path)} is a directory (Is a directory), not a tar file; copy the shard "
                        f"file there again or {_FIX}.") from None
    except OSError as err:
        raise UserError(f"cannot read shard {shown(path)} ({err.strerror or err}); {os_error_fix(err)}.") from None


class Unusual(Exception):
    """The direct header walk met something outside the plain layout; the tarfile walk decides."""


class PlainMember(NamedTuple):
    """A regular member as `plain_members` reads it: what tarfile's TarInfo says of it (its `name` decoded
    as tarfile decodes it), and the first bytes of its data, read with its header."""
    name: str
    offset_data: int
    size: int
    head: bytes

    def isreg(self) -> bool:
        return True


# The fixed-width ustar fields as Python's tarfile (`data pack`, webdataset's writer) and GNU tar write them, at
# 100:157 of a header: mode, uid, gid as 7 octal digits, size and mtime as 11, each ended by NUL or space, the
# checksum as 6 digits, NUL, space, and the type: '0' or NUL (a file) or 'x' (a pax header for the next);
# at 329:346 devmajor and devminor (octal or empty) and the first byte of an empty name prefix.
_PLAIN_FIELDS = re.compile(rb"[0-7]{7}[\0 ][0-7]{7}[\0 ][0-7]{7}[\0 ]([0-7]{11})[\0 ][0-7]{11}[\0 ][0-7]{6}\0 ([0\0x])")
_PLAIN_DEV = re.compile(rb"(?:[0-7]{7}[\0 ]|\0{8}){2}\0")
_PAX_TIME = re.compile(rb"(\d+) [acm]time=-?\d+(?:\.\d+)?\n")   # a pax record that names no path and no size
_ZERO_BLOCK = bytes(512)


def plain_members(path: Path) -> list[PlainMember]:
    """Every member of an uncompressed tar, read from its headers directly: about one `pread` per member, a
    few times faster than tarfile's walk, for the plain layout that tar writers produce.

    It accepts only what tarfile reads the same way: regular members with octal fields, an unsigned checksum
    that holds, no name prefix and no GNU extension, pax headers only of times (mtime, atime, ctime: what
    webdataset's writer adds to each member), the archive ending in a zero block or at the end of the file
    with every member whole. Anything else, damage included, raises Unusual, and the caller walks the shard
    with tarfile, which names the problem or reads the unusual layout.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # O_NONBLOCK: a FIFO named like a shard must not block
    except OSError:
        raise Unusual from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            raise Unusual                  # a directory, a FIFO, a device, an empty file: tarfile's walk names it
        return _plain_walk(fd, info.st_size)
    except OSError:
        raise Unusual from None
    finally:
        os.close(fd)


def _plain_walk(fd: int, size: int) -> list[PlainMember]:
    members: list[PlainMember] = []
    heads: list[bytes] = []                # every header's checksum, checked at the end, all at once
    sums: list[int] = []
    off, pax = 0, False
    while off < size:
        block = os.pread(fd, 1024, off)
        head = block[:512]                 # a header cut short cannot pass `off > size` below
        if head == _ZERO_BLOCK:
            break                          # the end of the archive (tarfile stops at the first zero block)
        fields = _PLAIN_FIELDS.fullmatch(head, 100, 157)
        if fields is None or _PLAIN_DEV.fullmatch(head, 329, 346) is None:
            raise Unusual
        heads.append(head)
        sums.append(int(head[148:154], 8))
        n = int(fields[1], 8)
        data = off + 512
        off = data + -(-n // 512) * 512
        if off > size:
            raise Unusual                  # a member or its padding runs past the end
        if fields[2] == b"x":              # pax records of times alone, NUL padding: they change no offset
            if pax or n > 512 or block[512 + n:1024].strip(b"\0"):
                raise Unusual
            pos = 512
            while pos < 512 + n:
                record = _PAX_TIME.match(block, pos, 512 + n)
                if record is None or int(record[1]) != record.end() - pos:
                    raise Unusual
                pos = record.end()
            pax = True
            continue
        end = head.find(b"\0", 0, 100)
        name = head[:100 if end < 0 else end].decode(tarfile.ENCODING, "surrogateescape")   # as tarfile does
        if name.endswith("/") and fields[2] == b"\0":
            raise Unusual                  # tarfile reads this as a directory
        members.append(PlainMember(name, data, n, block[512:512 + n]))
        pax = False
    if pax:
        raise Unusual                      # a pax header with no member after it
    if heads:
        blocks = np.frombuffer(b"".join(heads), np.uint8).reshape(-1, 512)
        got = blocks.sum(1, dtype=np.int64) - blocks[:, 148:156].sum(1, dtype=np.int64) + 256
        if not np.array_equal(got, np.asarray(sums, dtype=np.int64)):
            raise Unusual
    return members


class PlainReader:
    """`read_member` for `plain_members`'s members of one shard: a member's bytes from those read with its header
    where they are all there, else by `pread` on one descriptor, opened at the first such member and held to
    the end of the `with` block; `read_member`'s sentence when the file cannot be read or has changed."""

    def __init__(self, path: Path, where: str, fix: str = _FIX) -> None:
        self.path, self.where, self.fix, self.fd = path, where, fix, -1

    def __enter__(self) -> PlainReader:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __call__(self, member: PlainMember) -> bytes:
        if member.size <= len(member.head):
            return member.head[:member.size]
        try:
            if self.fd < 0:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)   # a FIFO put there since must not block
            data = os.pread(self.fd, member.size, member.offset_data)
        except OSError as err:
            raise UserError(f"shard {self.where}: cannot read member {shown(member.name)} ({err}); "
                            f"{self.fix}.") from None
        if len(data) != member.size:
            raise UserError(f"shard {self.where}: cannot read member {shown(member.name)} (the file ends after "
                            f"{len(data)} of its {member.size} bytes); {self.fix}.")
        return data


def _plain_keys(path: Path, num_classes: int) -> list[int]:
    """check_split's fast path: the keys of one shard in order, each label checked, from `plain_members`.
    Only a shard that the tarfile walk (`_samples_in`, `_label`) accepts gets keys; any problem raises
    Unusual, so that walk names it."""
    keys: list[int] = []
    seen: set[int] = set()
    key, have = -1, 0                      # have: 1 = the key's image seen, 2 = its label
    for member in plain_members(path):
        name = _MEMBER.fullmatch(member.name)
        if name is None:
            raise Unusual
        k, bit = int(name[1]), 1 if name[2] == "jpg" else 2
        if k != key:
            if have not in (0, 3) or k in seen:
                raise Unusual              # an incomplete sample, or a key twice
            seen.add(k)
            keys.append(k)
            key, have = k, 0
        if have & bit:
            raise Unusual                  # a member twice
        have |= bit
        if bit == 2:
            text = member.head[:member.size].strip()
            if member.size > 20 or not text.isdigit() or int(text) >= num_classes:
                raise Unusual
    if have not in (0, 3):
        raise Unusual
    return keys


_HEAD, _TAIL = 4096, 16384   # the bytes of a shard that its fingerprint covers: the first and the last


def read_ends(path: Path) -> tuple[int, bytes]:
    """A regular file's size and its first `_HEAD` and last `_TAIL` bytes (they overlap in a small file);
    OSError for anything else (a FIFO opens without blocking and is refused)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{shown(path)} is not a regular file")
        return info.st_size, os.pread(fd, _HEAD, 0) + os.pread(fd, _TAIL, max(0, info.st_size - _TAIL))
    finally:
        os.close(fd)


def _digest(count: int, max_label: int, ends: bytes) -> str:
    return hashlib.sha256(b"%d %d\0" % (count, max_label) + ends).hexdigest()


def fingerprint(path: Path, count: int, max_label: int, ends: tuple[int, bytes] | None = None) -> dict:
    """Step 6's record of a shard as written, for its index entry: `size`, `max_label` (its largest label, -1
    for none) and `ends`, the SHA-256 of the count, that label and the file's ends. `ends`: `read_ends(path)`
    if read already (before a walk that gave the count)."""
    size, data = ends if ends is not None else read_ends(path)
    return {"size": size, "max_label": max_label, "ends": _digest(count, max_label, data)}


def unchanged(path: Path, entry: Mapping, count: int, num_classes: int) -> bool:
    """Step 6's check of one shard, O(1) in its samples: True when its index `entry` has a fingerprint, the file
    matches it and its labels are classes; False for anything else (no fingerprint, another size or other ends,
    a missing or unreadable file), which the caller walks so that the walk names what is wrong, if anything."""
    size, top, ends = entry.get("size"), entry.get("max_label"), entry.get("ends")
    if not (isinstance(size, int) and isinstance(top, int) and isinstance(ends, str) and top < num_classes):
        return False
    try:
        got = read_ends(path)
    except OSError:
        return False
    return got[0] == size and _digest(count, top, got[1]) == ends


def _claim(owner: np.ndarray, i: int, keys: list[int], root: Path, split: str, entry: dict, path: Path) -> None:
    """Record that shard `i` (at `path`) holds `keys`; a key outside the split or held by an earlier shard is
    one sentence, the first such key in the shard's order."""
    total = entry["total"]
    for key in keys:
        if key >= total:
            raise UserError(f"shard {shown(path)} holds key {key:09d}, outside 0..{total - 1} of the {total} "
                            f"{split} samples in {INDEX}; {_FIX}.")
        if owner[key] >= 0:
            raise UserError(f"key {key:09d} is in shard {shown(path)} and in shard "
                            f"{shown(root / entry['shards'][owner[key]]['name'])}; each sample must be "
                            f"in one shard once: {_FIX}.")
        owner[key] = i


def check_split(root: Path, split: str, entry: dict, num_classes: int) -> list[int]:
    """Refuse a damaged split before any training (step 6): every shard whose fingerprint holds is taken as
    pack wrote it (its keys the contiguous range of its position); every other shard is walked: an
    uncompressed tar whose members (headers only, and each label's few bytes) are the samples index.json says,
    each key of 0..total-1 once across the split. Returns the positions of the shards it walked.

    For a set packed with fingerprints this reads O(shards) bytes; the walk is about one 512-byte header read
    per member, directly (`_plain_keys`) for shards in the plain layout, and through tarfile, which names what
    is wrong, for any other.
    """
    owner = np.full(entry["total"], -1, dtype=np.int32)   # which shard holds each key
    walk, start = [], 0
    for i, shard in enumerate(entry["shards"]):
        if unchanged(root / shard["name"], shard, shard["count"], num_classes):
            owner[start:start + shard["count"]] = i
        else:
            walk.append(i)
        start += shard["count"]
    for i in walk:   # after every fingerprinted range is claimed: a walked shard holding one of its keys is named
        _walk_shard(owner, i, root, split, entry, num_classes)
    return walk


def _walk_shard(owner: np.ndarray, i: int, root: Path, split: str, entry: dict, num_classes: int) -> None:
    """check_split's walk of shard `i`: its keys claimed in `owner`, its count compared with index.json's."""
    shard = entry["shards"][i]
    path = root / shard["name"]
    try:
        keys = _plain_keys(path, num_classes)
        _claim(owner, i, keys, root, split, entry, path)
        count = len(keys)
    except Unusual:
        count = _tar_walk(owner, i, root, split, entry, path, num_classes)
    if count != shard["count"]:
        why = "the shard is truncated or" if count < shard["count"] else "the shard has extra samples or"
        raise UserError(f"shard {shown(path)} holds {count} samples but {INDEX} lists {shard['count']} ({why} "
                        f"{INDEX} is wrong); {_FIX}.")


def _tar_walk(owner: np.ndarray, i: int, root: Path, split: str, entry: dict, path: Path, num_classes: int) -> int:
    """check_split's walk of one shard through tarfile, member by member: the first problem in the shard's
    order is one sentence. The number of samples it holds."""
    tar, size = _open_shard(path)
    count = 0
    with tar:
        for key, group in _samples_in(tar, shown(path), size):
            _claim(owner, i, [key], root, split, entry, path)
            _label(tar, shown(path), group["cls"], num_classes)
            count += 1
    return count


def _read_pieces(root: Path, names: list[str], counts: list[int], pieces: list[tuple[int, int, int]],
                 num_classes: int) -> Iterator[tuple[str, int, bytes, int]]:
    """Step 3: (shard name, key, jpeg bytes, label) of each piece, sequentially, skipping by seek.

    A shard that ends before the piece does, holds more samples than listed, or is damaged in any other way, is
    a UserError naming it: a sample is never dropped silently (check_split refuses such a shard at start-up;
    this catches one that changed since, and damage inside a shard that its fingerprint does not cover).
    """
    for shard, first, stop in pieces:
        path = root / names[shard]
        tar, size = _open_shard(path)
        sample = -1
        with tar:
            for key, group in _samples_in(tar, shown(path), size):
                sample += 1
                if sample >= stop:
                    if stop == counts[shard]:
                        raise UserError(f"shard {shown(path)} holds more than the {counts[shard]} samples {INDEX} "
                                        f"lists (it changed since it was packed, or {INDEX} is wrong); {_FIX}.")
                    break
                if sample < first:
                    continue  # skipped by seek: tarfile does not read data we do not extract
                label = _label(tar, shown(path), group["cls"], num_classes)
                yield names[shard], key, read_member(tar, shown(path), group["jpg"]), label
        if sample + 1 < stop:
            raise UserError(f"shard {shown(path)} holds {sample + 1} samples but {INDEX} lists {counts[shard]} "
                            f"(it is truncated or {INDEX} is wrong); {_FIX}.")


class _ShardStream(IterableDataset):
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
                 stream: type[_ShardStream] | None = None, repair: str = _FIX) -> None:
        """`stream`: the worker-side reader (another shard layout's, e.g. wds.WdsStream); `repair`: the fix its
        sentences name."""
        names = [s["name"] for s in split["shards"]]
        counts = [int(s["count"]) for s in split["shards"]]
        self.total = int(split["total"])
        self.rank, self.world = rank, world
        self.augment, self.workers, self.on_corrupt, self.repair = augment, workers, on_corrupt, repair
        self.stream = (stream or _ShardStream)(root, names, counts, num_classes=num_classes, size=size, min_scale=min_scale,
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
                    fix = "re-pack from a clean ImageFolder" if self.repair == _FIX else "replace it"
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
            fix = ("remove them from the ImageFolder and re-pack with 'largebatch data pack'" if self.repair == _FIX
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


def check_index(index: object, root: Path) -> None:
    """index.json's fields, as `pack` writes them: one sentence naming the first that is missing or mistyped."""
    where = shown(root / INDEX)

    def bad(field: str, want: str) -> UserError:
        return UserError(f"{where}: {field} is missing or not {want}; re-run 'largebatch data pack' (or fix "
                         f"{INDEX}).")

    def count(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(index, dict):
        raise bad("the top level", "an object")
    classes = index.get("classes")
    if not isinstance(classes, list) or len(classes) < 2 or not all(isinstance(c, str) for c in classes):
        raise bad("classes", "a list of 2 or more class names")
    splits = index.get("splits")
    if not isinstance(splits, dict):
        raise bad("splits", "an object with train and val")
    for split in ("train", "val"):
        entry = splits.get(split)
        if not isinstance(entry, dict):
            raise bad(f"splits.{split}", "an object with total and shards")
        if not count(entry.get("total")) or entry["total"] == 0:
            raise bad(f"splits.{split}.total", "a positive whole number")
        shards = entry.get("shards")
        if not isinstance(shards, list) or not shards:
            raise bad(f"splits.{split}.shards", "a non-empty list")
        for i, shard in enumerate(shards):
            field = f"splits.{split}.shards[{i}]"
            if not isinstance(shard, dict):
                raise bad(field, "an object with name and count")
            name = shard.get("name")
            if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
                raise bad(f"{field}.name", "a file name in data.root")
            if not count(shard.get("count")):
                raise bad(f"{field}.count", "a whole number of samples")
            if "size" in shard and not count(shard["size"]):   # step 6's fingerprint, written since build 5
                raise bad(f"{field}.size", "a whole number of bytes")
            if "max_label" in shard and not (isinstance(shard["max_label"], int) and shard["max_label"] >= -1):
                raise bad(f"{field}.max_label", "a class number (or -1)")
            if "ends" in shard and not (isinstance(shard["ends"], str) and re.fullmatch("[0-9a-f]{64}", shard["ends"])):
                raise bad(f"{field}.ends", "a SHA-256 in hex")
        listed = sum(shard["count"] for shard in shards)
        if listed != entry["total"]:
            raise UserError(f"{where}: splits.{split}.total is {entry['total']} but its shards' counts add up to "
                            f"{listed}; re-run 'largebatch data pack' (or fix {INDEX}).")


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
