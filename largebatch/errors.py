"""Errors a user can cause, and the one place that turns them into exit code 2.

A `UserError` carries one sentence naming the problem and the fix. Bugs are not
UserErrors: they keep their tracebacks.
"""
from __future__ import annotations

import errno
import os
import sys

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input from a user: config, data, command line, world size."""


def fs_bytes(path: object) -> bytes:
    """A path's name as bytes, as on disk. Linux names are bytes; Python keeps a byte that is not UTF-8 as a
    lone surrogate (``os.fsdecode``), which a strict text stream cannot encode: write these bytes instead."""
    if isinstance(path, bytes):
        return path
    text = str(path)
    try:
        return os.fsencode(text)
    except UnicodeEncodeError:   # a surrogate no file name decodes to
        return text.encode("utf-8", "surrogatepass")


def shown(path: object) -> str:
    """A path as text any stream can print: unchanged where its name is UTF-8, ``\\xNN`` for each byte that is not."""
    return fs_bytes(path).decode("utf-8", "backslashreplace")


def report(err: UserError) -> int:
    """Print the error once and return exit code 2.

    Under torchrun every rank that meets the error raises it, often the same sentence on every rank
    (a bad config) and sometimes on one rank alone (its data, its node). The first rank to report a
    given sentence prints it; the others stay quiet (`first_report`). A byte of a path that is not UTF-8
    is printed as ``\\xNN`` (`shown`).
    """
    text = shown(f"largebatch: error: {err}")   # a path in it may be any bytes
    if first_report(text):
        print(text, file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def env_int(name: str, default: int, low: int = 0, high: int | None = None, fix: str = "") -> int:
    """The environment variable `name` as a whole number in [low, high] (`default` when unset); anything else is
    one sentence naming the variable (a UserError). `fix` says how to set it right."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        span = f"{low} to {high}" if high is not None else f"{low} or more"
        raise UserError(f"the environment variable {name} is {raw!r}; it must be a whole number, {span}"
                        f"{'; ' + fix if fix else ''}.")
    return value


def env_float(name: str, default: float, low: float = 0.0) -> float:
    """The environment variable `name` as a number >= `low` (`default` when unset), else one sentence."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= low or value == float("inf"):
        raise UserError(f"the environment variable {name} is {raw!r}; it must be a number, {low:g} or more.")
    return value


def first_report(text: str) -> bool:
    """Whether this process is the first of its run to report `text`: a counter per sentence in the
    launcher's store (torchrun's MASTER_ADDR:MASTER_PORT). True outside torchrun, where the variables that
    reach the store are not as torchrun sets them (the sentence is then about them: asking a store they cannot
    name would only delay it by the store's timeout), or if the store is unreachable (then every rank prints:
    better twice than never)."""
    where = _store_address()
    if where is None:
        return True
    try:
        import datetime
        import hashlib

        import torch.distributed as dist

        store = dist.TCPStore(*where, is_master=False, timeout=datetime.timedelta(seconds=2), wait_for_workers=False)
        key = (f"largebatch/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/attempt"
               f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/reported/"
               f"{hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}")
        return store.add(key, 1) == 1
    except Exception:   # noqa: BLE001 - no store: print
        return True


def _store_address() -> tuple[str, int] | None:
    """(MASTER_ADDR, MASTER_PORT) of a multi-process run whose WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT are
    as torchrun sets them (a rank below the world size, a port, a host this machine resolves); else None."""
    import socket

    try:
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if world <= 1 or not 0 <= rank < world or not 0 < port < 65536:
            return None
        socket.getaddrinfo(addr, port)
    except (KeyError, ValueError, UnicodeError, socket.gaierror):
        return None
    return addr, port


_OS_FIXES: dict[int | None, str] = {   # keyed by OSError.errno, which may be None
    errno.ENOSPC: "free space on that disk or write elsewhere",
    errno.EDQUOT: "free space within your quota or write elsewhere",
    errno.EACCES: "check its permissions or choose a path you can write to",
    errno.EPERM: "check its permissions or choose a path you can write to",
    errno.EROFS: "choose a path on a writable file system",
    errno.ENOTDIR: "a part of the path is a file, not a directory; fix the path",
    errno.EISDIR: "it is a directory; give a file path",
    errno.EEXIST: "a file is where a directory is needed; move it or give another path",
    errno.ENOENT: "check that the path exists",
    errno.ENAMETOOLONG: "use a shorter path",
}


def os_error_fix(err: OSError, default: str = "check the path, its permissions and the free space") -> str:
    """The fix for an OSError on a path the user gave, by its errno."""
    return _OS_FIXES.get(err.errno, default)


def describe_os_error(err: OSError) -> str:
    """One sentence for an OSError on a path the user gave (the path, what failed, the fix)."""
    where = f" {err.filename}" if err.filename else ""
    if err.filename2:
        where += f" -> {err.filename2}"
    what = err.strerror or str(err)
    return f"cannot use{where}: {what}; {os_error_fix(err)}."
