"""The writer of largebatch/data/shards.py's layout: `largebatch data pack SRC_IMAGEFOLDER DST_DIR` (its command
line: largebatch/commands/data/pack.py).

`pack` writes ``train-000000.tar ...`` and ``val-000000.tar ...``, each member pair ``<key>.jpg`` + ``<key>.cls``
(the label as ASCII), samples in a seeded shuffled order, plus ``index.json`` (classes, and per split the shards
with their sample counts and each shard's fingerprint, `shard_check.fingerprint`). ``key`` is the sample's
position in its split (``%09d``), which is also the image index that keys its augmentation. Everything is written
into a temporary sibling of the destination and renamed into place at the end.
"""
from __future__ import annotations

import fcntl
import glob
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Callable

import torch

from largebatch.data.shard_check import fingerprint
from largebatch.data.tar import INDEX
from largebatch.errors import UserError, os_error_fix, shown


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
