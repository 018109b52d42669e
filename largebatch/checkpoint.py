"""Checkpoints that cannot be corrupted.

1. The state is serialised with `torch.save` into memory and its SHA-256 computed.
2. The bytes go to a temporary file in the same directory, which is fsync'ed and renamed
   over the final name (rename is atomic on POSIX), then the directory is fsync'ed.
3. A metadata file (`step-XXXXXXXX.json`: step, epoch, size, sha256) is written the same
   way *after* the checkpoint: a checkpoint without metadata is incomplete and ignored.
4. `latest()` walks from the newest checkpoint back, verifying size and checksum; a corrupt or
   truncated one is reported by name and the previous good one is used.
5. Loading uses `torch.load(weights_only=True)`: no pickled code runs.
A kill at any moment leaves the previous checkpoint intact.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import time
from pathlib import Path

import torch

PREFIX = "step-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:   # a full disk, or an interrupt: no half-written temporary file stays behind
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def save(state: dict, directory: Path, step: int, *, keep: int | None = None, meta: dict | None = None) -> Path:
    """Write `state` as checkpoint `step` in `directory`; keep the newest `keep` (None: all)."""
    directory.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    path = directory / f"{PREFIX}{step:08d}.pt"
    atomic_write(path, data)
    info = {"step": step, "file": path.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "time": time.time(), **(meta or {})}
    atomic_write(path.with_suffix(".json"), json.dumps(info, indent=1).encode())
    if keep is not None:
        prune(directory, keep)
    return path


def _metas(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{PREFIX}*.json"), reverse=True)


def prune(directory: Path, keep: int) -> None:
    metas = _metas(directory)
    for meta in metas[keep:]:
        meta.unlink(missing_ok=True)   # metadata first: a kill in between leaves an ignored .pt, never a
        meta.with_suffix(".pt").unlink(missing_ok=True)   # metadata file pointing at nothing
    kept = {m.with_suffix(".pt").name for m in metas[:keep]}
    if metas:
        for orphan in directory.glob(f"{PREFIX}*.pt"):   # older data files whose metadata was removed
            if orphan.name not in kept and orphan.name < metas[0].with_suffix(".pt").name:
                orphan.unlink(missing_ok=True)
    for tmp in directory.glob(".tmp-*"):  # leftovers of a writer killed mid-write
        if time.time() - tmp.stat().st_mtime > 60:
            tmp.unlink(missing_ok=True)


def verify(meta_path: Path) -> dict | None:
    """The metadata if the checkpoint it describes is complete and intact, else None."""
    try:
        meta = json.loads(meta_path.read_text())
        data = meta_path.with_suffix(".pt").read_bytes()
    except (OSError, ValueError):
        return None
    if len(data) != meta.get("size") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        return None
    return meta


def latest(directory: Path, *, warn=None) -> tuple[Path, dict] | None:
    """Newest intact checkpoint in `directory` (corrupt ones are reported and skipped)."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not directory.is_dir():
        return None
    for meta_path in _metas(directory):
        meta = verify(meta_path)
        if meta is not None:
            return meta_path.with_suffix(".pt"), meta
        warn(f"largebatch: checkpoint {meta_path.with_suffix('.pt')} is corrupt or truncated "
             f"(checksum mismatch); skipping it for an older one.")
    return None


def all_intact(directory: Path) -> list[tuple[Path, dict]]:
    return [(m.with_suffix(".pt"), meta) for m in _metas(directory) if (meta := verify(m)) is not None]


def load(path: Path, map_location="cpu") -> dict:
    return torch.load(path, map_location=map_location, weights_only=True)


def restore(module_or_optimizer, state: dict, what: str, path: Path, fix: str) -> None:
    """`load_state_dict`, with a failure turned into one sentence naming what differs and the fix."""
    from largebatch.errors import UserError

    try:
        result = module_or_optimizer.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as err:
        detail = " ".join(str(err).split())
        if len(detail) > 300:
            detail = detail[:300] + "..."
        raise UserError(f"checkpoint {path} does not fit this {what} ({detail}); {fix}") from None
    return result
