"""WebDataset shards as published (`data.dataset: webdataset`), and `largebatch data index ROOT`.

Layout read: uncompressed tar shards whose members are grouped into samples by key, as the `webdataset` library
groups them (the key is the member's path up to the first dot of its file name, the extension the rest,
lower-cased; consecutive members of one key are one sample; directories, links and `__*__` files are passed
over). A sample is one image, `<key>.jpg`, `.jpeg` or `.png` (the first of these present), and one label:
`<key>.cls` (the class index as text) or, without it, `<key>.json` with a `label` field (or `cls`), as the
ImageNet-1k WebDataset copies on the Hugging Face hub are laid out. Other members are ignored. Labels are
classes `0..data.num_classes-1`.

Where the shards are (`data.root`, `data.val_root`):

1. A brace pattern, `.../train-{000000..001023}.tar` (ranges keep their zero padding; `{a,b}` lists; a `*`
   glob too): its shards, in the pattern's order. A pattern that names no existing file is refused.
2. A directory: with `train/` and `val/` (or `validation/`) folders, their `*.tar` files; otherwise its `*.tar`
   files whose names contain `train`, and those whose names contain `val`, each in name order.
3. `data.val_root` (a directory or pattern) names the evaluation shards; with a pattern as `data.root`, it is
   needed.

Per-shard sample counts (the exactly-once split needs them before reading): for each shard, from an index in
its directory: largebatch's `index.json` (the one `data pack` writes, or the one `largebatch data index` writes,
which is a `wids` shard list), or any `*.json` `wids` shard list (`"__kind__": "wids-shard-index-v1"`,
`shardlist` entries with `url` and `nsamples`; `url` matched by file name). A shard in no index is refused,
naming `largebatch data index`.

Reading is `shards.py`'s (its steps 1-5 and 7-8): the shards in a seeded permutation per epoch (training) or
in order (evaluation), concatenated into one sequence of `n` samples; each rank takes a contiguous range of it
and each loader worker a contiguous part of that, so every sample is read by exactly one (rank, worker) in
evaluation and at most once in training (exactly once where the epoch's steps use every sample). A sample's
augmentation is keyed by its position in the sequence in listed order, so it does not depend on ranks or
workers. Start-up (6'), O(shards) where the index has fingerprints: a shard whose index entry carries the
fingerprint that `largebatch data index` (and `data pack`) record (`size`, `max_label`, `ends`:
`shard_check.fingerprint`, the SHA-256 of the count, the largest label and the file's first 4 KiB and last 16 KiB)
and whose file matches it, with `max_label` < `data.num_classes`, is not walked: one open and two small reads.
Every other shard is walked once (tar headers, and each label's bytes; no image decoded; the headers read
directly in the plain layouts, webdataset's writer's pax time records included, through tarfile otherwise:
`tar.plain_members`): a shard of an index without fingerprints (a `wids` list as published, or one written
before build 5: walked at each start; `largebatch data index` again adds them), or one changed since it was
indexed. A sample without an image or a label, a label that is no whole number or is outside the classes, a
damaged or truncated tar, or a count other than the index's is one sentence naming the shard and member, before
any run directory is taken. Damage of the same size inside a fingerprinted shard (between its ends) is met by
the loader worker that reads it (the same rules, and a shard ending early or holding more samples than listed),
one sentence, exit 2 (`shards.py` step 7). An image that does not decode follows `data.on_corrupt`, listed as
`<shard>/<member>`. Why this and not a cache of walks keyed by size and mtime: no cache directory to own, no
mtime that a copy changes, and the same check for both shard layouts.

`largebatch data index ROOT` (its command line: largebatch/commands/data/index.py; ROOT a directory or pattern; a
directory's `train/` and `val/` folders too) walks the shards the same way and writes `index.json` in each shard
directory: a `wids` shard list of the shards' file names and counts, each with its fingerprint (entries for other
shards of an index of this kind are kept; the fingerprint fields are extra keys beside `url` and `nsamples`, not
checked against the `wids` reader itself). It is written to a temporary file and renamed into place; the shards are
only read. An `index.json` of `data pack`, or a file that is no shard list, is never overwritten.
"""
from __future__ import annotations

import glob
import json
import os
import re
import tarfile
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

from largebatch.data.shard_check import fingerprint, read_ends, unchanged
from largebatch.data.shards import ShardSource, ShardStream
from largebatch.data.tar import (INDEX, PlainMember, PlainReader, Unusual, members, open_shard, plain_members,
                                 read_member)
from largebatch.errors import UserError, os_error_fix, shown

WIDS_KIND = "wids-shard-index-v1"
IMAGES = ("jpg", "jpeg", "png")
LABEL_FIELDS = ("label", "cls")
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")   # webdataset's base_plus_ext: key, extension
_COPY = "copy the shard again"
_INDEX_FIX = "run 'largebatch data index {}' again after fixing it"


# ---- where the shards are ----------------------------------------------------------------------

def expand_braces(pattern: str) -> list[str]:
    """Brace expansion as the `braceexpand` package (used by webdataset) does it: `{000..123}` keeps the
    zero padding of its ends, `{a,b,c}` lists alternatives, braces nest; left to right."""
    start = pattern.find("{")
    if start < 0:
        return [pattern]
    depth = 0
    for end in range(start, len(pattern)):
        depth += {"{": 1, "}": -1}.get(pattern[end], 0)
        if depth == 0:
            break
    else:
        raise UserError(f"pattern {pattern!r} has a '{{' without its '}}'; close the brace.")
    inner, rest = pattern[start + 1:end], pattern[end + 1:]
    numbers = re.fullmatch(r"(-?\d+)\.\.(-?\d+)", inner)
    if numbers:
        a, b = numbers.groups()
        width = max(len(a), len(b)) if a.startswith("0") or b.startswith("0") else 0
        step = 1 if int(b) >= int(a) else -1
        options = [f"{i:0{width}d}" for i in range(int(a), int(b) + step, step)]
    else:
        options, depth, last = [], 0, 0
        for i, ch in enumerate(inner):
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                options.append(inner[last:i])
                last = i + 1
        options.append(inner[last:])
        options = [o for opt in options for o in expand_braces(opt)]
    head = pattern[:start]
    return [head + o + r for o in options for r in expand_braces(rest)]


def _listed(spec: str, key: str) -> list[Path]:
    """Step 1: the existing files a pattern names (every one must exist)."""
    names = [n for part in expand_braces(spec) for n in (sorted(glob.glob(part)) if glob.has_magic(part) else [part])]
    paths = [Path(n) for n in names]
    present = [p for p in paths if p.is_file()]
    if not present:
        raise UserError(f"{key} {spec} matches no file ({len(paths)} names, none exists); give the shards' "
                        "directory or a pattern of existing files.")
    if len(present) < len(paths):
        missing = next(p for p in paths if not p.is_file())
        raise UserError(f"{key} {spec}: shard {shown(missing)} does not exist ({len(paths) - len(present)} of "
                        f"{len(paths)} are missing); copy them or narrow the pattern.")
    return paths


def _in_directory(root: Path, key: str) -> tuple[list[Path], list[Path]]:
    """Step 2: a directory's training and evaluation shards."""
    folders = [root / "train", root / "val", root / "validation"]
    if folders[0].is_dir() and (folders[1].is_dir() or folders[2].is_dir()):
        val_dir = folders[1] if folders[1].is_dir() else folders[2]
        train, val = sorted(folders[0].glob("*.tar")), sorted(val_dir.glob("*.tar"))
    else:
        tars = sorted(root.glob("*.tar"))
        train = [p for p in tars if "train" in p.name]
        val = [p for p in tars if "val" in p.name]
    if not train:
        raise UserError(f"{key} {root} holds no training shards (*.tar named *train*, or a train/ folder); give "
                        "the directory of the shards or a brace pattern of them.")
    return train, val


def locate(root: str, val_root: str | None) -> tuple[list[Path], list[Path]]:
    """Steps 1-3: the training and evaluation shards of `data.root` and `data.val_root`."""
    if Path(root).is_dir():
        train, val = _in_directory(Path(root), "data.root")
    elif "{" in root or glob.has_magic(root):
        train, val = _listed(root, "data.root"), []
    elif Path(root).exists():
        train, val = [Path(root)], []
    else:
        raise UserError(f"data.root {root} does not exist; give the directory of the shards or a brace pattern "
                        "(train-{000000..001023}.tar).")
    if val_root is not None and Path(val_root).is_dir():
        val = sorted(Path(val_root).glob("*.tar"))
        if not val:
            raise UserError(f"data.val_root {val_root} holds no *.tar shards; give the evaluation shards' directory "
                            "or a brace pattern of them.")
    elif val_root is not None:
        val = _listed(val_root, "data.val_root")
    if not val:
        raise UserError(f"data.root {root} names no evaluation shards; set data.val_root to their directory or "
                        "brace pattern (or put shards named *val* beside the training shards).")
    return train, val


# ---- per-shard counts ---------------------------------------------------------------------------

_MARKS = ("size", "max_label", "ends")   # a shard's fingerprint fields in an index entry (shard_check.fingerprint)


def _read_index(path: Path) -> dict[str, dict] | None:
    """A shard index's entries by shard file name, each {"count": n} and the fingerprint fields it has:
    largebatch's index.json (data pack's) or a wids shard list; None for a JSON file that is neither."""
    try:
        if path.stat().st_size > 64 * 2**20:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        if path.name == INDEX:
            raise UserError(f"cannot read {shown(path)} ({err}); remove it and run 'largebatch data index "
                            f"{shown(path.parent)}'.") from None
        return None
    if not isinstance(data, dict):
        return None
    out: dict[str, dict] = {}
    if data.get("__kind__") == WIDS_KIND and isinstance(data.get("shardlist"), list):
        for entry in data["shardlist"]:
            url, n = (entry.get("url"), entry.get("nsamples")) if isinstance(entry, dict) else (None, None)
            if not isinstance(url, str) or not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise UserError(f"{shown(path)}: a shardlist entry {str(entry)[:80]} has no url and whole-number "
                                f"nsamples; fix it, or remove it and run 'largebatch data index {shown(path.parent)}'.")
            out[url.rstrip("/").rsplit("/", 1)[-1]] = {"count": n, **{k: entry[k] for k in _MARKS if k in entry}}
        return out
    if data.get("format") == "largebatch-shards-1" and isinstance(data.get("splits"), dict):
        for entry in data["splits"].values():
            for shard in entry.get("shards", []) if isinstance(entry, dict) else []:
                if isinstance(shard, dict) and isinstance(shard.get("name"), str) and isinstance(shard.get("count"), int):
                    out[shard["name"]] = {"count": shard["count"], **{k: shard[k] for k in _MARKS if k in shard}}
        return out
    return None


def counts(paths: list[Path]) -> tuple[list[int], list[Path], list[dict]]:
    """Each shard's sample count, the index file it came from (index.json first, then other wids lists) and its
    entry there (the count and any fingerprint fields)."""
    found: dict[Path, list[tuple[Path, dict[str, dict]]]] = {}
    out, sources, entries = [], [], []
    for path in paths:
        folder = path.parent
        if folder not in found:
            files = [folder / INDEX] if (folder / INDEX).is_file() else []
            files += [p for p in sorted(folder.glob("*.json")) if p.name != INDEX]
            found[folder] = [(f, got) for f in files if (got := _read_index(f)) is not None]
        hit = next(((f, got[path.name]) for f, got in found[folder] if path.name in got), None)
        if hit is None:
            raise UserError(f"shard {shown(path)} has no sample count in an index beside it (index.json or a wids "
                            f"shard list); count once with 'largebatch data index {shown(folder)}'.")
        sources.append(hit[0])
        out.append(hit[1]["count"])
        entries.append(hit[1])
    return out, sources, entries


# ---- samples -------------------------------------------------------------------------------------

Member = TypeVar("Member", tarfile.TarInfo, PlainMember)   # as tarfile reads it, or tar.plain_members


def samples_in(members: Iterable[Member], where: str, size: int) -> Iterator[tuple[str, dict[str, Member]]]:
    """Each sample of a shard in order, from its members' headers alone: (key, {extension: member}), grouped
    as webdataset groups them (consecutive members of one key)."""
    key: str | None = None
    group: dict[str, Member] = {}
    for member in members:
        if not member.isreg():
            continue
        base = member.name.rsplit("/", 1)[-1]
        if "/" not in member.name and base.startswith("__") and base.endswith("__"):
            continue
        match = _KEY.match(member.name)
        if not match:
            continue
        if member.offset_data + member.size > size:
            raise UserError(f"shard {where} is truncated: member {shown(member.name)} needs "
                            f"{member.offset_data + member.size} bytes, the file has {size}; {_COPY}.")
        k, ext = match.group(1), match.group(2).lower()
        if k != key:
            if key is not None:
                yield key, group
            key, group = k, {}
        group.setdefault(ext, member)
    if key is not None:
        yield key, group


def image_member(where: str, key: str, group: dict[str, Member]) -> Member:
    member = next((group[e] for e in IMAGES if e in group), None)
    if member is None:
        raise UserError(f"shard {where}: sample {shown(key)} has no image ({', '.join(key + '.' + e for e in IMAGES)}; "
                        f"members: {', '.join(sorted(group))}); give shards of images with labels.")
    return member


def label_of(read: Callable[[Member], bytes], where: str, key: str, group: dict[str, Member],
             num_classes: int | None) -> int:
    """The class of a sample: <key>.cls as text, else the label field of <key>.json; in 0..num_classes-1
    (None: any whole number >= 0). `read` gives a member's bytes."""
    if "cls" in group:
        member = group["cls"]
        text = read(member).strip() if member.size <= 20 else b""
        if not re.fullmatch(rb"-?\d+", text):
            what = repr(text) if member.size <= 20 else f"{member.size} bytes"
            raise UserError(f"shard {where}: label member {shown(member.name)} holds {what}, not a class number; "
                            "write the class index as text.")
        value = int(text)
    elif "json" in group:
        member = group["json"]
        try:
            meta = json.loads(read(member)) if member.size <= 2**20 else None
        except ValueError:
            meta = None
        field = next((f for f in LABEL_FIELDS if isinstance(meta, dict) and f in meta), None)
        if field is None:
            raise UserError(f"shard {where}: sample {shown(key)} has no .cls label and its {shown(member.name)} is "
                            f"no JSON object with a {' or '.join(LABEL_FIELDS)} field; give each sample a label.")
        given = meta[field]   # type: ignore[index]
        if not isinstance(given, int) or isinstance(given, bool):
            raise UserError(f"shard {where}: {shown(member.name)} has {field} {str(given)[:40]!r}, not a class "
                            "number; write the class index.")
        value = given
    else:
        raise UserError(f"shard {where}: image {shown(image_member(where, key, group).name)} has no label "
                        f"({key}.cls, or {key}.json with a label field); give each sample a label.")
    if value < 0 or (num_classes is not None and value >= num_classes):
        bound = f"0..{num_classes - 1} (data.num_classes is {num_classes})" if num_classes else "0 or more"
        raise UserError(f"shard {where}: {shown(member.name)} holds class {value}, outside {bound}; set "
                        "data.num_classes to the number of classes, or fix the label.")
    return value


def walk(path: Path, num_classes: int | None) -> tuple[int, int]:
    """Step 6': a shard's sample count and its largest label, every sample checked (image present, label
    readable and in range); no image is decoded. The headers are read directly (`tar.plain_members`) in
    the plain layouts, through tarfile in any other; the same members either way, so the same rules and
    sentences."""
    where = shown(path)
    try:
        plain = plain_members(path)
    except Unusual:
        tar, size = open_shard(path)
        with tar:
            return _count(samples_in(members(tar, where, _COPY), where, size), where, num_classes,
                          lambda m: read_member(tar, where, m, fix=_COPY))
    try:
        size = path.stat().st_size
    except OSError as err:   # gone since its headers were read
        raise UserError(f"cannot read shard {where} ({err.strerror or err}); {os_error_fix(err)}.") from None
    with PlainReader(path, where, _COPY) as read:
        return _count(samples_in(plain, where, size), where, num_classes, read)


def _count(samples: Iterable[tuple[str, dict[str, Member]]], where: str, num_classes: int | None,
           read: Callable[[Member], bytes]) -> tuple[int, int]:
    n, top = 0, -1
    for key, group in samples:
        image_member(where, key, group)
        top = max(top, label_of(read, where, key, group, num_classes))
        n += 1
    return n, top


def check_counts(paths: list[Path], listed: list[int], sources: list[Path], num_classes: int,
                 entries: list[dict] | None = None) -> list[Path]:
    """Start-up (6'): every shard whose index entry's fingerprint holds is taken as indexed (O(1) each); every
    other shard is walked and its count must be its index's. Returns the shards it walked."""
    walked = []
    for i, (path, want, source) in enumerate(zip(paths, listed, sources)):
        if entries is not None and unchanged(path, entries[i], want, num_classes):
            continue
        walked.append(path)
        n, _ = walk(path, num_classes)
        if n != want:
            raise UserError(f"shard {shown(path)} holds {n} samples but {shown(source)} lists {want}; "
                            f"{_INDEX_FIX.format(shown(path.parent))}.")
    return walked


# ---- reading ---------------------------------------------------------------------------------------

class WdsStream(ShardStream):
    """`shards.ShardStream` with webdataset's sample layout: names are the shards' paths, a sample's key
    (its augmentation key) its position in the listed order."""

    def _read(self, pieces: list[tuple[int, int, int]]) -> Iterator[tuple[str, int, bytes, int]]:
        offsets = [0]
        for c in self.counts:
            offsets.append(offsets[-1] + c)
        for shard, first, stop in pieces:
            path = Path(self.names[shard])
            tar, size = open_shard(path)
            where = shown(path)
            sample = -1
            with tar:
                def read(member: tarfile.TarInfo) -> bytes:
                    return read_member(tar, where, member, fix=_COPY)

                for key, group in samples_in(members(tar, where, _COPY), where, size):
                    sample += 1
                    if sample >= stop:
                        if stop == self.counts[shard]:
                            raise UserError(f"shard {where} holds more than the {stop} samples its index lists (it "
                                            "changed since it was indexed); "
                                            f"{_INDEX_FIX.format(shown(path.parent))}.")
                        break
                    if sample < first:
                        continue   # passed over by seeking: tarfile reads no data we do not extract
                    member = image_member(where, key, group)
                    label = label_of(read, where, key, group, self.num_classes)
                    yield f"{path.name}/{member.name}", offsets[shard] + sample, read(member), label
            if sample + 1 < stop:
                raise UserError(f"shard {where} holds {sample + 1} samples but its index lists {self.counts[shard]} "
                                f"(it is truncated or the index is stale); {_INDEX_FIX.format(shown(path.parent))}.")


def build_webdataset(cfg, seed: int):
    """(train, test, info) of `data.dataset: webdataset`."""
    from largebatch.data.info import IMAGENET_MEAN, IMAGENET_STD, DatasetInfo
    from largebatch.dist import env_info

    train_paths, val_paths = locate(cfg.root, cfg.val_root)
    splits = {}
    for split, paths in (("train", train_paths), ("val", val_paths)):
        listed, sources, entries = counts(paths)
        check_counts(paths, listed, sources, cfg.num_classes, entries)
        splits[split] = {"total": sum(listed),
                         "shards": [{"name": str(p.absolute()), "count": c} for p, c in zip(paths, listed)]}
        if splits[split]["total"] == 0:
            raise UserError(f"the {split} shards of data.root {cfg.root} hold no samples; give shards with samples.")
    dist = env_info()
    common = dict(num_classes=cfg.num_classes, size=cfg.image_size, min_scale=cfg.min_scale, seed=seed,
                  workers=cfg.loader_workers, on_corrupt=cfg.on_corrupt, rank=dist.rank, world=dist.world_size,
                  stream=WdsStream, repair=_INDEX_FIX.format(cfg.root))
    train = ShardSource(Path("/"), splits["train"], augment=cfg.augment, **common)
    test = ShardSource(Path("/"), splits["val"], augment=False, **common)
    name = Path(cfg.root).name if Path(cfg.root).is_dir() else Path(cfg.root).parent.name
    info = DatasetInfo(cfg.num_classes, 3, cfg.image_size, IMAGENET_MEAN, IMAGENET_STD, len(train), len(test),
                       f"webdataset:{name}")
    return train, test, info


# ---- largebatch data index ----------------------------------------------------------------------------

def _write_atomic(path: Path, text: str) -> None:
    """`path` holds `text` whole or is as it was: a temporary file in the same directory, fsync, rename."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        with open(tmp, "x") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def index(root: str, say=print) -> dict[Path, dict]:
    """Walk the shards of `root` and write each shard directory's index.json (see the module docstring);
    returns what was written, by file. Everything is checked before anything is written."""
    if Path(root).is_dir():
        base = Path(root)
        dirs = [d for d in (base / "train", base / "val", base / "validation") if d.is_dir()]
        paths = [p for d in [base, *dirs] for p in sorted(d.glob("*.tar"))]
        if not paths:
            raise UserError(f"{root} holds no *.tar shards (nor do its train/ and val/ folders); give the shards' "
                            "directory or a brace pattern of them.")
    elif "{" in root or glob.has_magic(root):
        paths = _listed(root, "ROOT")
    else:
        what = "is not a directory or pattern of shards" if Path(root).exists() else "does not exist"
        raise UserError(f"{root} {what}; give the shards' directory or a brace pattern (train-{{000000..000099}}.tar).")
    by_dir: dict[Path, dict[str, dict]] = {}
    top = -1
    for path in paths:
        try:
            ends = read_ends(path)   # before the walk: a shard changed during it fails its fingerprint later
        except OSError:
            ends = None              # the walk names what is wrong with it
        n, label = walk(path, None)
        top = max(top, label)
        marks = fingerprint(path, n, label, ends) if ends is not None else {}   # gone since: no quick check
        by_dir.setdefault(path.parent, {})[path.name] = {"nsamples": n, **marks}
    out: dict[Path, dict] = {}
    for folder, found in by_dir.items():
        target = folder / INDEX
        kept: list[dict] = []
        if target.exists():
            try:
                old = json.loads(target.read_text())
            except (OSError, ValueError):
                old = None
            if isinstance(old, dict) and old.get("format") == "largebatch-shards-1":
                raise UserError(f"{shown(target)} was written by 'largebatch data pack' and already holds the counts; "
                                "data.dataset shards reads it (nothing was written).")
            if not (isinstance(old, dict) and old.get("__kind__") == WIDS_KIND and isinstance(old.get("shardlist"), list)):
                raise UserError(f"{shown(target)} exists and is not a wids shard list; move it away, then index again "
                                "(nothing was written).")
            kept = [e for e in old["shardlist"] if isinstance(e, dict) and str(e.get("url", "")).rsplit("/", 1)[-1]
                    not in found]
        entries = kept + [{"url": name, **entry} for name, entry in found.items()]
        entries.sort(key=lambda e: str(e.get("url")))
        out[target] = {"__kind__": WIDS_KIND, "wids_version": 1, "name": folder.name, "shardlist": entries}
    for target, data in out.items():
        _write_atomic(target, json.dumps(data, indent=1) + "\n")
        found = by_dir[target.parent]
        say(f"{shown(target)}: {len(found)} shards, {sum(e['nsamples'] for e in found.values())} samples")
    if top >= 0:
        say(f"labels seen: 0..{top} at most; set data.num_classes to the number of classes (e.g. {top + 1})")
    return out
