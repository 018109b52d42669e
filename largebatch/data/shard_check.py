"""Step 6 of largebatch/data/shards.py: the start-up check of a shard set that `data pack` wrote, and the rules
of its layout that the check and the reader (step 7) both apply.

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

The rules of the layout, judged from the tar headers (`samples_in`) and a label's bytes (`read_label`), are the
reader's too (shards.py step 7), so a shard the check accepts reads without a sentence, and a shard damaged since
is named in the same words.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
import tarfile
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np

from largebatch.data.tar import FIX, INDEX, Unusual, members, open_shard, plain_members, read_member
from largebatch.errors import UserError, shown


_MEMBER = re.compile(r"(\d{1,18})\.(jpg|cls)", re.ASCII)   # a key of ASCII digits


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


def samples_in(tar: tarfile.TarFile, where: str, size: int) -> Iterator[tuple[int, dict[str, tarfile.TarInfo]]]:
    """Each sample of a shard in order: (key, {"jpg": member, "cls": member}), from the headers alone.

    A sample is the consecutive members of one key; each must be a regular file named <key>.jpg or <key>.cls
    inside the archive, lying wholly inside the file; both must be there, once each; a key comes once.
    """
    key, seen = -1, set()
    group: dict[str, tarfile.TarInfo] = {}
    for member in members(tar, where):
        problem = _member_problem(member, size)
        if problem:
            raise UserError(f"shard {where} {problem}; {FIX}.")
        stem, _, ext = member.name.partition(".")
        k = int(stem)
        if k != key:
            if group:
                yield key, _complete(where, key, group)
            if k in seen:
                raise UserError(f"shard {where} holds key {stem} twice (member {shown(member.name)} again after "
                                f"other keys); {FIX}.")
            seen.add(k)
            key, group = k, {}
        if ext in group:
            raise UserError(f"shard {where} holds member {shown(member.name)} twice; {FIX}.")
        group[ext] = member
    if group:
        yield key, _complete(where, key, group)


def _complete(where: str, key: int, group: dict[str, tarfile.TarInfo]) -> dict[str, tarfile.TarInfo]:
    if "cls" not in group:
        raise UserError(f"shard {where}: image {shown(group['jpg'].name)} has no label member "
                        f"({key:09d}.cls); {FIX}.")
    if "jpg" not in group:
        raise UserError(f"shard {where}: label {shown(group['cls'].name)} has no image member "
                        f"({key:09d}.jpg); {FIX}.")
    return group


def read_label(tar: tarfile.TarFile, where: str, member: tarfile.TarInfo, num_classes: int) -> int:
    """The class of a <key>.cls member: a decimal number in 0..num_classes-1."""
    text = read_member(tar, where, member).strip() if member.size <= 20 else b""
    if not text.isdigit():
        what = f"{text!r}" if member.size <= 20 else f"{member.size} bytes"
        raise UserError(f"shard {where}: label member {shown(member.name)} holds {what}, not a class number; "
                        f"{FIX}.")
    label = int(text)
    if label >= num_classes:
        raise UserError(f"shard {where}: label member {shown(member.name)} holds class {label}, outside "
                        f"0..{num_classes - 1} ({INDEX} lists {num_classes} classes); {FIX}, or list every "
                        f"class in {INDEX}.")
    return label


def _plain_keys(path: Path, num_classes: int) -> list[int]:
    """check_split's fast path: the keys of one shard in order, each label checked, from `plain_members`.
    Only a shard that the tarfile walk (`samples_in`, `read_label`) accepts gets keys; any problem raises
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
                            f"{split} samples in {INDEX}; {FIX}.")
        if owner[key] >= 0:
            raise UserError(f"key {key:09d} is in shard {shown(path)} and in shard "
                            f"{shown(root / entry['shards'][owner[key]]['name'])}; each sample must be "
                            f"in one shard once: {FIX}.")
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
                        f"{INDEX} is wrong); {FIX}.")


def _tar_walk(owner: np.ndarray, i: int, root: Path, split: str, entry: dict, path: Path, num_classes: int) -> int:
    """check_split's walk of one shard through tarfile, member by member: the first problem in the shard's
    order is one sentence. The number of samples it holds."""
    tar, size = open_shard(path)
    count = 0
    with tar:
        for key, group in samples_in(tar, shown(path), size):
            _claim(owner, i, [key], root, split, entry, path)
            read_label(tar, shown(path), group["cls"], num_classes)
            count += 1
    return count


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
