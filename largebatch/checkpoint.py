"""Checkpoints that cannot be corrupted.

1. The state is serialised with `torch.save` into memory and its SHA-256 computed.
2. The bytes go to a temporary file in the same directory, which is fsync'ed and renamed
   over the final name (rename is atomic on POSIX), then the directory is fsync'ed.
3. A metadata file (`step-XXXXXXXX.json`: step, epoch, size, sha256) is written the same
   way *after* the checkpoint: a checkpoint without metadata is incomplete and ignored.
4. `latest()` walks from the newest checkpoint back, verifying size and checksum; a corrupt or
   truncated one is reported by name and the previous good one is used. A checkpoint is sound as well as
   intact: `save` writes none whose tensors are not all finite (a run that diverged holds weights of inf or
   NaN, and every resume from them would diverge again) and records `finite` in the metadata; `latest` skips,
   naming it, one of an older writer whose tensors are not finite.
5. Loading uses `torch.load(weights_only=True)`: no pickled code runs.
6. `RunState` gathers a training run's parts into one checkpoint and restores them on a resume.
7. Deleting only what the run wrote: before a checkpoint's two files are written, their names are
   appended to the directory's manifest (`MANIFEST`, one name per line). `prune` removes only
   regular files (never a symbolic link) that the manifest names, and the temporary files of the
   writer's own naming (`.tmp-step-...-PID`); a file the run did not write (a checkpoint copied in by
   hand, a file named like one, a checkpoint of a version that kept no manifest) is never deleted
   and does not count towards `keep`. Files are written with O_NOFOLLOW into a directory that is no
   symbolic link: a link is refused, never written through.
8. The two writers of every file a run (and `evaluate`, `bench --json`, `plan --calibrate`, `chaos`) writes:
   `atomic_write` (whole or absent: steps 2's temporary name, fsync, rename; the temporary removed on any
   failure) and `append_whole` for the append-only files (metrics.jsonl, the manifest: a line is appended
   whole or not at all, a write cut short by a full disk is cut back). Their OSError names the path.
A kill at any moment leaves the previous checkpoint intact.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import random
import re
import stat
import sys
import time
from pathlib import Path

import torch

PREFIX = "step-"
MANIFEST = ".largebatch-written"   # step 7: the names of the files this directory's writer created
# atomic_write's temporary names, of ours: ".tmp-NAME-PID" of a checkpoint's data or metadata (groups: the step,
# the pid) or of the manifest (no step)
OWN_TMP = re.compile(rf"\.tmp-(?:{re.escape(PREFIX)}(\d+)\.(?:pt|json)|{re.escape(MANIFEST)})-(\d+)")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """`path` holds `data` whole, or is as it was: the bytes go to a temporary name in the same directory
    (O_NOFOLLOW), are fsync'ed and renamed over `path`. On any failure (a full disk, an interrupt) the temporary
    file is removed and the OSError names `path` (a failed write names no file of its own)."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        # O_NOFOLLOW: a symbolic link at the temporary name is refused (ELOOP), never written through; the
        # rename replaces `path` itself, never the file a link there points to
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:   # a full disk, or an interrupt: no half-written temporary file stays behind
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno != errno.ELOOP and exc.filename in (None, str(tmp)):
            exc.filename = str(path)
        raise
    _fsync_dir(path.parent)


def append_whole(fd: int, data: bytes, path: Path) -> None:
    """Append `data` (whole lines) to the file open at `fd` (O_APPEND), whole or not at all: a write cut short
    (a full disk) is undone by cutting the file back to its size before, so no torn line stays behind for a
    reader, and the OSError names `path`."""
    start = os.fstat(fd).st_size
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        if exc.filename is None:
            exc.filename = str(path)
        raise


def non_finite(state) -> str | None:
    """The first floating-point tensor in `state` (nested dicts, lists and tuples) holding a NaN or an infinity,
    named by its keys ('model.fc.weight'); None when all are finite. One host sync per device they are on."""
    named: list[tuple[str, torch.Tensor]] = []

    def walk(value, where: str) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.numel():
                named.append((where, value))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{where}.{k}" if where else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]")

    walk(state, "")
    if not named:
        return None
    ok: dict[int, bool] = {}
    for device in {t.device for _, t in named}:   # one host sync per device, not one per tensor
        index = [i for i, (_, t) in enumerate(named) if t.device == device]
        ok.update(zip(index, torch.stack([named[i][1].isfinite().all() for i in index]).tolist()))
    return next((named[i][0] for i in range(len(named)) if not ok[i]), None)


def save(state: dict, directory: Path, step: int, *, keep: int | None = None, meta: dict | None = None
         ) -> Path | None:
    """Write `state` as checkpoint `step` in `directory`; keep the newest `keep` of those written here (None: all).
    Nothing is written (None) when a tensor of `state` is not finite (step 4), and the caller is told why by
    `non_finite`."""
    if non_finite(state) is not None:
        return None
    if directory.is_symlink():   # step 7: written through, pruning would delete files of another directory
        from largebatch.errors import UserError

        raise UserError(f"{directory} is a symbolic link, and a run writes only inside its own directory; replace "
                        "the link by a real directory, or give another --run-dir.")
    directory.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    path = directory / f"{PREFIX}{step:08d}.pt"
    _record(directory, [path.name, path.with_suffix(".json").name])   # before the files exist: a kill leaves none
    atomic_write(path, data)                                          # unrecorded
    info = {"step": step, "file": path.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "time": time.time(), "finite": True, **(meta or {})}
    atomic_write(path.with_suffix(".json"), json.dumps(info, indent=1).encode())
    if keep is not None:
        prune(directory, keep)
    return path


def _metas(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{PREFIX}*.json"), reverse=True)


def _record(directory: Path, names: list[str]) -> None:
    """Step 7: append `names` to the manifest, in one write (a kill cannot leave half a line)."""
    fd = os.open(directory / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        append_whole(fd, "".join(f"{n}\n" for n in names).encode(), directory / MANIFEST)
        os.fsync(fd)
    finally:
        os.close(fd)


def recorded(directory: Path) -> set[str]:
    """Step 7: the names the manifest holds (files this directory's writer created, some since pruned)."""
    try:
        fd = os.open(directory / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return set()
    with os.fdopen(fd) as f:
        return {line.strip() for line in f if line.strip()}


def _regular(path: Path) -> bool:
    """A regular file itself, not a symbolic link (to one) nor anything else."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def prune(directory: Path, keep: int) -> None:
    """Step 7: remove the checkpoints this directory's writer recorded, but the newest `keep` of them."""
    ours = recorded(directory)
    metas = [m for m in _metas(directory) if m.name in ours and _regular(m)]
    removed = set()
    for meta in metas[keep:]:
        meta.unlink(missing_ok=True)   # metadata first: a kill in between leaves an ignored .pt, never a
        data = meta.with_suffix(".pt")  # metadata file pointing at nothing
        if data.name in ours and _regular(data):
            data.unlink(missing_ok=True)
        removed |= {meta.name, data.name}
    kept = {m.with_suffix(".pt").name for m in metas[:keep]}
    if metas:
        for orphan in directory.glob(f"{PREFIX}*.pt"):   # older data files of ours whose metadata was removed
            if (orphan.name in ours and orphan.name not in kept and orphan.name < metas[0].with_suffix(".pt").name
                    and _regular(orphan)):
                orphan.unlink(missing_ok=True)
                removed.add(orphan.name)
    for tmp in directory.glob(".tmp-*"):  # leftovers of our writer killed mid-write
        if OWN_TMP.fullmatch(tmp.name) and _regular(tmp) and time.time() - tmp.lstat().st_mtime > 60:
            tmp.unlink(missing_ok=True)
    if removed:   # the manifest forgets them: a file put under a pruned name later is not ours
        atomic_write(directory / MANIFEST, "".join(f"{n}\n" for n in sorted(ours - removed)).encode())


def verify(meta_path: Path) -> dict | None:
    """The metadata if the checkpoint it describes is complete and intact, else None."""
    try:
        meta = json.loads(meta_path.read_text())
        data = meta_path.with_suffix(".pt").read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):   # a foreign JSON file
        return None
    if len(data) != meta.get("size") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        return None
    return meta


def latest(directory: Path, *, warn=None) -> tuple[Path, dict] | None:
    """Newest intact and sound checkpoint in `directory` (step 4: corrupt ones and, of an older writer, ones
    whose tensors are not finite are named and skipped)."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not directory.is_dir():
        return None
    for meta_path in _metas(directory):
        meta = verify(meta_path)
        path = meta_path.with_suffix(".pt")
        if meta is None:
            warn(f"largebatch: checkpoint {path} is corrupt or truncated (checksum mismatch); skipping it.")
            continue
        if "finite" not in meta:   # written before save checked: look
            with contextlib.suppress(Exception):   # not loadable: the caller's load names it
                bad = non_finite(load(path))
                if bad is not None:
                    warn(f"largebatch: checkpoint {path} holds non-finite values ({bad}: written as its run "
                         "diverged); skipping it.")
                    continue
        return path, meta
    return None


def written(directory: Path) -> list[Path]:
    """The checkpoints of `directory` whose metadata was written (complete when written; intact or not now)."""
    return [m.with_suffix(".pt") for m in _metas(directory)] if directory.is_dir() else []


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


class RunState:
    """Step 6: a training run's state as one checkpoint: the model, optimizer, loss scaler, EMA model, the
    noise-scale averages, the comm hook's fields (without its process group: plain data, loads with
    weights_only), the progress counters, the RNG states and the step; restored the same way on a resume."""

    FIX = ("resume with the recipe and --set options the run was started with (its config.yaml), or start "
           "a new run with a fresh --run-dir.")
    KEYS = ("model", "optimizer", "scaler", "step", "rng", "progress")   # what every checkpoint of a run holds

    def __init__(self, directory: Path, *, model, optimizer, scaler, ema, noise, comm_state, progress,
                 config_hash: str, optimizer_name: str, keep: int | None, main: bool, meta: dict | None = None):
        self.directory, self.model, self.optimizer, self.scaler, self.ema = directory, model, optimizer, scaler, ema
        self.noise, self.comm_state, self.progress = noise, comm_state, progress
        self.config_hash, self.optimizer_name, self.keep, self.main = config_hash, optimizer_name, keep, main
        self.meta = meta or {}   # written into every checkpoint's metadata (the trainer's: the config, the world size)

    def state_dict(self, step: int, session_wall: float) -> dict:
        return {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(), "ema": self.ema.state_dict() if self.ema is not None else {},
            "step": step, "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "progress": self.progress.state_dict(session_wall), "config_hash": self.config_hash,
            "optimizer_name": self.optimizer_name,
            "comm": self.comm_state.__getstate__() if self.comm_state is not None else {},
            "noise_scale": self.noise.state_dict() if self.noise is not None else {},
        }

    def save(self, step: int, epoch: float, session_wall: float) -> Path | None:
        """The checkpoint of `step`, or None (nothing written, said) when the run's state is not finite."""
        state = self.state_dict(step, session_wall)
        path = save(state, self.directory, step, keep=self.keep,
                    meta={"epoch": epoch, "config_hash": self.config_hash, **self.meta})
        if path is None and self.main:
            sound = latest(self.directory, warn=lambda m: None)
            print(f"largebatch: no checkpoint written at step {step}: {non_finite(state)} is not finite (the run is "
                  f"diverging); the newest sound checkpoint is "
                  f"{sound[0] if sound else 'none'}.", file=sys.stderr, flush=True)
        return path

    def latest(self) -> tuple[Path, dict] | None:
        """The newest intact checkpoint (`latest`; corrupt ones said by the main process only)."""
        return latest(self.directory, warn=(lambda m: print(m, file=sys.stderr)) if self.main else (lambda m: None))

    def resume(self, found: tuple[Path, dict] | None | str = "latest") -> int | None:
        """The newest intact checkpoint (or `found`, the caller's `latest()`) loaded into every part; its step, or
        None when there is none yet (said by the main process). A checkpoint that does not fit is one UserError
        naming the fix. Which settings may differ from the checkpoint's is the caller's to judge
        (`resume.check_resume`: the trainer does it before building the model)."""
        from largebatch.errors import UserError

        if isinstance(found, str):
            found = self.latest()
        if found is None:
            if self.main:
                print(f"largebatch: no checkpoint in {self.directory}; starting from step 0.", file=sys.stderr)
            return None
        path, _ = found
        try:
            state = load(path)
            why = "" if isinstance(state, dict) else f"a {type(state).__name__}"
        except Exception as err:   # noqa: BLE001 - intact by its metadata, yet no torch checkpoint: a foreign file
            state, why = {}, f"torch.load failed: {' '.join(str(err).split())[:120] or type(err).__name__}"
        missing = [k for k in self.KEYS if k not in state] if not why else []
        if why or missing:
            raise UserError(f"checkpoint {path} is not a largebatch training checkpoint ({why or 'no ' + missing[0]}); "
                            f"move it and its .json out of {self.directory} to resume from an older one, or start a "
                            "new run with a fresh --run-dir.")
        written_by = state.get("optimizer_name", self.optimizer_name)
        if written_by != self.optimizer_name:   # its state would load, then fail (or mislead) at the first step
            raise UserError(f"checkpoint {path} was written with optim.name={written_by} but this run uses "
                            f"{self.optimizer_name}; {self.FIX}")
        built, was = self.meta.get("model"), found[1].get("model")   # models/external.py: Built.record()
        if built and isinstance(was, dict) and was.get("identity") != built.get("identity"):
            raise UserError(f"checkpoint {path} was written by model {was.get('name')} ({was.get('identity')}; "
                            f"{was.get('source')}) but this run builds {built['identity']} ({built['source']}); "
                            f"install what the run was trained with, or {self.FIX}")
        restore(self.model, state["model"], "model", path, self.FIX)
        restore(self.optimizer, state["optimizer"], f"optimizer ({self.optimizer_name})", path, self.FIX)
        self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and state.get("ema"):
            restore(self.ema, state["ema"], "EMA model", path, self.FIX)
        elif self.ema is not None:   # train.ema turned on at this resume: the average starts at the restored weights
            self.ema.module.load_state_dict(self.model.state_dict())
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if self.noise is not None and state.get("noise_scale"):
            self.noise.load_state_dict(state["noise_scale"])
        self.progress.load_state_dict(state["progress"])
        if self.main:
            print(f"largebatch: resumed from {path} at step {state['step']}.", file=sys.stderr)
        return state["step"]
