"""A run directory belongs to its run.

1. A directory *holds a run* when any file a run writes is there: config.yaml, metrics.jsonl,
   summary.json, a checkpoint's metadata or a snapshot. Other files (a log the caller keeps
   there, for instance) do not make it a run.
2. `check(path, resume)` refuses, with one sentence naming the fix: a path that is not a
   directory, a directory that holds a run when `--resume` was not given, and a directory
   another process is writing (its lock is held).
3. `claim(path, resume)` does the same under the lock and keeps it: `fcntl.flock` on
   ``path/.largebatch.lock`` (pid and host written inside, for the message), held by the one
   process that writes (rank 0) until it exits. The kernel drops the lock when that process dies,
   however it dies, so a killed run never leaves a stale lock behind, and an elastic restart's new
   rank 0 takes it over.
4. A directory that `claim` creates is made 0755; an existing one keeps its mode (a shared 1777
   directory keeps its sticky bit).
5. `watch_parent()`: workers ask the kernel for SIGTERM when their launcher dies (Linux
   PR_SET_PDEATHSIG), so a SIGKILLed launcher never leaves workers writing behind a new run's back:
   they stop at the next step with a checkpoint, as after any SIGTERM.
6. `agree(...)`: in a distributed run rank 0 claims, and every rank learns the path or the refusal.
7. What a run may take (refused by `check` and `claim` too, one sentence naming the fix):
   - never a system directory: `/` and its top-level directories (/etc, /usr, /home, /tmp, ...),
     anything under /etc, /usr, /bin, /sbin, /lib*, /boot, /dev, /proc, /sys, and the user's home
     directory; judged on the real path, so a symbolic link to one of them is refused too;
   - a directory that holds no run only when it is empty or holds nothing but what a run writes
     (`OWN_FILES`, `OWN_DIRS`) and a caller's logs (`*.log`, e.g. a study cell's train.log); a
     directory of other files (a project, a home, runs/ with other runs in it) is not taken over;
   - a directory that holds a run: with `--resume`; the files of others in it are left alone.
8. A run writes only inside its own directory: none of its own names (`OWN_FILES`, `OWN_DIRS`) may
   be a symbolic link, nor any entry of its sub-directories (a link there would be written through,
   or replaced, or deleted by pruning). `open_own`, `write_own` and `own_dir` are the writers' side: files
   opened with O_NOFOLLOW (`write_own`: whole or absent, through `checkpoint.atomic_write`), sub-directories
   that are no links. What it deletes: `checkpoint.prune` removes only
   checkpoints the run recorded in its manifest as written by it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import socket
from pathlib import Path

from largebatch.errors import UserError

LOCK = ".largebatch.lock"
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json")
STATUSES = ("finished", "diverged")   # summary.json's status; a run stopped by a signal has none (it resumes)
# Step 7: everything a run creates at the top of its directory, and the sub-directories it writes into.
OWN_FILES = (*RUN_FILES, "corrupt_images.txt", LOCK)
OWN_DIRS = ("checkpoints", "snapshots", "plots", "tensorboard")
CALLER_LOGS = "*.log"
# A run directory is never one of these, nor anything under SYSTEM_TREES (judged on the real path).
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/sbin", "/sys",
                "/usr")
SYSTEM_DIRS = ("/", "/home", "/mnt", "/media", "/opt", "/root", "/run", "/srv", "/tmp", "/var", "/var/tmp")


def holds_run(path: Path) -> bool:
    """Step 1: whether `path` holds (the start of) a largebatch run."""
    if not path.is_dir():
        return False
    if any((path / name).exists() for name in RUN_FILES):
        return True
    return any((path / "checkpoints").glob("step-*.json")) or any((path / "snapshots").glob("*"))


def _shown(path: Path, real: Path) -> str:
    return f"{path}" if Path(os.path.abspath(path)) == real else f"{path} (which leads to {real})"


def refuse_system(path: Path, flag: str = "--run-dir") -> None:
    """Step 7: a system directory or the home directory, by its real path (also a study's --out)."""
    real = Path(os.path.realpath(path))
    home = Path(os.path.realpath(Path.home()))
    trees = [Path(t) for t in SYSTEM_TREES]
    if real == home:
        raise UserError(f"{flag} {_shown(path, real)} is your home directory; give a directory of its own, "
                        "e.g. runs/NAME.")
    if real in (*map(Path, SYSTEM_DIRS), *trees) or any(t in real.parents for t in trees):
        raise UserError(f"{flag} {_shown(path, real)} is a system directory; give a directory of its own, "
                        "e.g. runs/NAME.")


def link_sentence(path: Path) -> str:
    """The refusal of a symbolic link among a run's own names (step 8)."""
    try:
        to = f" to {os.readlink(path)}"
    except OSError:
        to = ""
    return (f"{path} is a symbolic link{to}, and a run writes only inside its own directory; replace the link by "
            "a real directory or file, or give another --run-dir.")


def _refuse_links(path: Path) -> None:
    """Step 8: none of the run's own names is a symbolic link, nor anything in its sub-directories."""
    for name in (*OWN_FILES, *OWN_DIRS):
        if (path / name).is_symlink():
            raise UserError(link_sentence(path / name))
    for name in OWN_DIRS:
        if (path / name).is_dir():
            with os.scandir(path / name) as entries:
                for entry in sorted(entries, key=lambda e: e.name):
                    if entry.is_symlink():
                        raise UserError(link_sentence(path / name / entry.name))


def foreign_entries(path: Path) -> list[str]:
    """Step 7: the names in `path` that neither a run nor its caller's logs account for, sorted."""
    own = {*OWN_FILES, *OWN_DIRS}
    with os.scandir(path) as entries:
        return sorted(e.name for e in entries
                      if e.name not in own and not (Path(e.name).match(CALLER_LOGS) and e.is_file(follow_symlinks=False)))


def _refuse_reasons(path: Path, resume: bool) -> None:
    refuse_system(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"--run-dir {path} is a file, not a directory; give a directory path for the run.")
    if not path.is_dir():
        return
    _refuse_links(path)
    if holds_run(path):
        if not resume:
            raise UserError(f"run directory {path} already holds a run; continue it with --resume, or give a fresh "
                            "--run-dir to start a new one.")
        return
    foreign = foreign_entries(path)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(f"--run-dir {path} holds files that are not a largebatch run's ({shown}); give a new or "
                        "empty --run-dir, so that the run neither mixes its files with them nor writes over them.")


def own_dir(path: Path) -> Path:
    """Step 8: a sub-directory of a run (`OWN_DIRS`), created when missing; refused when it is a symbolic link."""
    if path.is_symlink():
        raise UserError(link_sentence(path))
    path.mkdir(exist_ok=True)
    return path


def open_own(path: Path, mode: str = "w"):
    """Step 8: one of a run's files opened for writing ("w"/"wb" truncate, "a" appends), never through a symbolic
    link (O_NOFOLLOW: a link there is refused with `link_sentence`)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(link_sentence(path)) from None
        raise
    return os.fdopen(fd, mode)


def write_own(path: Path, data: bytes) -> None:
    """Step 8: one of a run's files written whole or not at all (`checkpoint.atomic_write`: a temporary name
    opened with O_NOFOLLOW, fsync, rename; a full disk leaves the old file or none); a symbolic link at `path` is
    refused with `link_sentence` (the rename would replace it, never write through it)."""
    from largebatch.checkpoint import atomic_write

    if path.is_symlink():
        raise UserError(link_sentence(path))
    try:
        atomic_write(path, data)
    except OSError as exc:
        if exc.errno == errno.ELOOP:   # a link made at the temporary name
            raise UserError(link_sentence(Path(exc.filename or path))) from None
        raise


def _holder(lock_path: Path) -> str:
    with contextlib.suppress(OSError):
        text = lock_path.read_text().strip()
        if text:
            return f" ({text})"
    return ""


def _in_use(path: Path, what: str = "run directory", flag: str = "--run-dir") -> UserError:
    return UserError(f"{what} {path} is in use by another largebatch process{_holder(path / LOCK)}; wait "
                     f"for it to finish or stop it, or give another {flag}.")


def in_use(path: Path) -> bool:
    """Whether a live process holds the run directory's lock (is writing the run now)."""
    try:
        fd = os.open(path / LOCK, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return True
        raise
    finally:
        os.close(fd)
    return False


def check(path: Path, resume: bool) -> None:
    """Step 2, without creating anything (the launcher's early check, before any worker starts)."""
    _refuse_reasons(path, resume)
    if in_use(path):
        raise _in_use(path)


class Claim:
    """Step 3: the exclusive lock on a run directory, held until `release()` or process exit."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)   # closing the descriptor drops the flock
            self._fd = None


def claim(path: Path, resume: bool) -> Claim:
    """Steps 2-4: create the directory if needed (0755), lock it, then refuse what `check` refuses."""
    _refuse_reasons(path, resume)
    try:
        path.mkdir(mode=0o755, parents=True)
        os.chmod(path, 0o755)   # mkdir's mode is masked by the umask; a directory we create is never world-writable
    except FileExistsError:
        pass
    except OSError as exc:
        raise UserError(f"cannot create run directory {path}: {exc.strerror}; give a --run-dir you can write to.") \
            from None
    held = lock(path)
    try:
        _refuse_reasons(path, resume)   # again under the lock: a run that finished a moment ago counts
    except UserError:
        held.release()
        raise
    return held


def lock(path: Path, what: str = "run directory", flag: str = "--run-dir") -> Claim:
    """Step 3's lock alone, on an existing directory (also a study's --out, `what` and `flag` naming it in the
    refusal): ``path/.largebatch.lock`` opened with O_NOFOLLOW, flocked, our pid and host written inside."""
    try:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(link_sentence(path / LOCK)) from None
        raise UserError(f"cannot write in {what} {path}: {exc.strerror}; give a {flag} you can write to.") \
            from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise _in_use(path, what, flag) from None
        raise
    os.ftruncate(fd, 0)
    # who holds it, for a refusal's message only: a full disk does not stop the lock (the first file the run
    # writes then names itself in the full disk's sentence)
    with contextlib.suppress(OSError):
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
    return Claim(path, fd)


def agree(run_dir: Path | None, resume: bool, *, main: bool, distributed: bool, default_name: str,
          store=None) -> tuple[Path, Claim | None]:
    """Step 6: the run directory every rank of a run agrees on, and rank 0's claim on it.

    Rank 0 picks the directory (`run_dir`, the one an earlier attempt of this elastic run chose, or
    runs/NAME-TIMESTAMP) and claims it; the path, or rank 0's refusal, is broadcast, so that every rank
    raises the same UserError (exit code 2 on every rank)."""
    import time

    import torch.distributed as dist

    from largebatch import reliability
    from largebatch.errors import describe_os_error

    path = [str(run_dir) if run_dir else "", ""]   # path, rank 0's error
    held = None
    if main:
        try:
            if not run_dir:
                remembered = reliability.remembered_run_dir(store)
                path[0] = str(remembered or Path("runs") / f"{default_name}-{time.strftime('%Y%m%d-%H%M%S')}")
            p = Path(path[0])
            held = claim(p, resume)
            reliability.remember_run_dir(store, p)
            own_dir(p / "checkpoints")
        except UserError as err:
            path[1] = str(err)
        except OSError as err:   # the run directory's disk or permissions: still every rank's error
            path[1] = describe_os_error(err)
    if distributed:
        dist.broadcast_object_list(path, src=0)
    if path[1]:
        if held is not None:
            held.release()
        raise UserError(path[1])
    return Path(path[0]), held


def watch_parent(parent: int | None = None) -> None:
    """Step 5: SIGTERM this worker when its launcher (parent) dies; Linux only, a no-op elsewhere. `parent`: the
    launcher's pid where the worker knows it (it may have died before this call, while the worker started)."""
    parent = os.getppid() if parent is None else parent
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:   # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
