"""Warm starts for the suite's `python -m largebatch ARGS` runs (tests/conftest.py `run_cli`).

A fresh interpreter spends about 2 s of a 2-core machine importing torch (and torch._dynamo, which the memory
estimate's meta-device forward pass imports), before largebatch does anything; the suite starts hundreds of them.
This server imports those libraries once, then forks a child per run, as multiprocessing's forkserver does with
its preload list: the child takes the run's working directory, environment and argv, points stdin at /dev/null
and stdout/stderr at the caller's files, and runs `largebatch` as `python -m` does (runpy's `_run_module_as_main`),
so it exits as the program does (`largebatch.cli.exit_now`) with the run's exit code. The run is a real process
with a pid of its own; it starts its workers, studies and launchers as any run does.

largebatch itself is not preloaded (it reads its environment when it imports): every run imports it afresh.
A run whose environment differs from this server's in a variable that the preloaded libraries read when they
import (`IMPORT_TIME`) is started cold by the caller instead.

Protocol, one connection per run on a Unix socket: the caller sends one JSON line {argv, cwd, env, stdout,
stderr}; the server answers {"pid": N} when the child starts and {"code": C} when it ends (C < 0: killed by
signal -C, as subprocess reports it)."""
from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import sys

PRELOAD = ("numpy", "torch", "torch._dynamo", "torch.distributed.run")
# the prefixes of variables that Python, the C runtime, OpenMP (libgomp reads OMP_NUM_THREADS when it loads),
# numpy's BLAS and torch read at start-up or import
IMPORT_TIME = ("PYTHON", "OMP_", "TORCH", "PYTORCH", "CUDA", "NCCL", "LD_", "LC_", "LANG", "TMPDIR", "HOME", "OPENBLAS",
               "MKL", "KMP", "GOMP", "NUMPY", "TZ")
# read when used, not at import, and written into os.environ by torch itself: inductor's first compile in a pytest
# worker (an in-process torch.compile test) sets TORCHINDUCTOR_CACHE_DIR there, after which every run of that worker
# started cold and test_warm_starts, placed after such a file, failed (the server's environment lacked it)
READ_WHEN_USED = ("TORCHINDUCTOR_CACHE_DIR",)


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in READ_WHEN_USED}


def _die_with_parent() -> None:
    """The server ends with the pytest worker that started it (Linux's PR_SET_PDEATHSIG; not inherited by the
    runs it forks)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run(request: dict) -> None:
    """In the forked child: become `python -m largebatch ARGV` in CWD with ENV; never returns."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    stdin = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import faulthandler

    faulthandler.enable()   # a run stopped for not ending (chaos.hung_report, from conftest) shows its stacks
    import runpy
    import tempfile

    tempfile.tempdir = None   # TMPDIR as the run's environment has it
    sys.path[0] = os.getcwd()   # python -m puts the working directory first
    sys.argv = ["-m", *request["argv"]]
    runpy._run_module_as_main("largebatch")   # type: ignore[attr-defined]  # what `python -m` calls
    sys.exit(0)


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:   # the caller went away (its test timed out or was interrupted); the run is waited for anyway
        pass


def serve(path: str) -> None:
    _die_with_parent()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    for module in PRELOAD:
        importlib.import_module(module)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn.makefile("rb") as f:
            request = json.loads(f.readline())
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            _run(request)
        _send(conn, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _send(conn, {"code": os.waitstatus_to_exitcode(status)})
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
