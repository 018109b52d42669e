import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FMNIST = Path("/usr/share/datasets/fashion-mnist")
# both tiers importable by name from either (an integration file takes its unit file's helpers: one copy)
sys.path[:0] = [str(ROOT / "tests" / "unit"), str(ROOT / "tests" / "integration")]

# Each pytest worker (pytest-xdist -n N) owns its share of the cores, as a launcher gives each training worker its
# share: the runs a test starts take OMP_NUM_THREADS from here (largebatch.dist.set_threads honours it, and the
# launcher passes it on). Without it two pytest workers each start 2-thread runs on 2 cores, and OpenMP threads
# that outnumber the cores spin at their barriers: a tiny run took 8x as long. A test may still set its own.
_PYTEST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _PYTEST_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _PYTEST_WORKERS)))


class _WarmStarts:
    """This pytest worker's client of tests/cli_zygote.py (one server per worker, started at the first run): a
    run forked from an interpreter that has torch imported. LARGEBATCH_TEST_COLD=1 starts every run cold."""

    def __init__(self):
        self.server: subprocess.Popen | None = None
        self.path = ""
        self.import_env: dict[str, str] = {}

    def _start(self, env: dict[str, str]) -> bool:
        import tempfile

        from cli_zygote import import_time_env

        import atexit
        import shutil

        home = tempfile.mkdtemp(prefix="largebatch-warm-")
        atexit.register(shutil.rmtree, home, True)
        self.path = os.path.join(home, "socket")
        self.server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "cli_zygote.py"), self.path],
                                       cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        assert self.server.stdout is not None
        if self.server.stdout.readline().strip() != b"ready":
            self.server.kill()
            self.server = None
            return False
        self.import_env = import_time_env(env)
        return True

    def usable(self, env: dict[str, str]) -> bool:
        from cli_zygote import import_time_env

        if os.environ.get("LARGEBATCH_TEST_COLD") == "1":
            return False
        if self.server is None or self.server.poll() is not None:
            if not self._start({**os.environ, "PYTHONUNBUFFERED": "1"}):
                return False
        return import_time_env(env) == self.import_env

    def run(self, argv: list[str], cwd, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        import json
        import locale
        import socket
        import tempfile

        def reply(conn, pending: bytearray):   # one JSON line from the server
            while b"\n" not in pending:
                chunk = conn.recv(4096)
                if not chunk:
                    raise RuntimeError("the warm-start server (tests/cli_zygote.py) ended during a run")
                pending += chunk
            line, _, rest = bytes(pending).partition(b"\n")
            pending[:] = rest
            return json.loads(line)

        def read(path):
            with open(path, encoding=locale.getpreferredencoding(False)) as f:
                return f.read()
        cmd = [sys.executable, "-m", "largebatch", *argv]
        with tempfile.TemporaryDirectory(prefix="largebatch-run-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": out, "stderr": err}
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.path)
                conn.sendall((json.dumps(request) + "\n").encode())
                pending = bytearray()
                pid = reply(conn, pending)["pid"]
                try:
                    conn.settimeout(timeout)
                    code = reply(conn, pending)["code"]
                except BaseException as exc:   # as subprocess.run: the run is killed and waited for
                    from largebatch.commands.chaos import hung_report

                    where = hung_report(pid)   # a run that did not end: where each of its processes was
                    with contextlib.suppress(ProcessLookupError):   # ended by the dump's SIGABRT
                        os.kill(pid, 9)
                    conn.settimeout(None)
                    reply(conn, pending)
                    if isinstance(exc, TimeoutError):
                        raise subprocess.TimeoutExpired(cmd, timeout, output=read(out),
                                                        stderr=read(err) + where) from None
                    exc.add_note(where + "\nthe run's stderr, last 4,000 characters:\n" + read(err)[-4000:])
                    raise
            return subprocess.CompletedProcess(cmd, code, read(out), read(err))


_WARM = _WarmStarts()


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the process's name: [state, ppid, pgrp, session, ...]."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def proc_ppid(pid: int) -> int:
    return int(proc_stat(pid)[1])


def proc_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        return proc_stat(pid)[0] != "Z"
    except OSError:
        return False


def proc_holds(pid: int, target: str) -> bool:
    """Whether process `pid` has a file open that is `target` (as /proc/PID/fd/N links name it)."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
    return False


def run_cli(*args, cwd=None, env=None, timeout=300, check=False):
    """Run `python -m largebatch ARGS` as a user would; returns the CompletedProcess. The process is forked from
    a server that has torch imported (tests/cli_zygote.py), unless the environment asks for a cold start."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    argv = [str(a) for a in args]
    if _WARM.usable(full_env):
        proc = _WARM.run(argv, cwd or ROOT, full_env, timeout)
    else:
        proc = subprocess.run([sys.executable, "-m", "largebatch", *argv], cwd=cwd or ROOT, env=full_env,
                              capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"largebatch {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def fmnist_copy(dest: Path) -> Path:
    """A copy of the Debian Fashion-MNIST files in the new folder `dest`, for a test to damage; `dest`."""
    import shutil

    dest.mkdir()
    for f in FMNIST.iterdir():
        shutil.copy(f, dest / f.name)
    return dest


def user_error(proc, *fragments):
    """A CompletedProcess that exited 2 with one `largebatch: error:` line holding every fragment, no traceback."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("largebatch: error:")]
    assert len(lines) == 1, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def pytest_report_header(config):
    """The stack the suite runs on (make test runs two: .venv and .venv-eco), read from the installed packages'
    metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(lib):
        try:
            return f"{lib} {version(lib)}"
        except PackageNotFoundError:
            return f"no {lib}"

    return "stack: " + ", ".join(installed(lib) for lib in ("torch", "torchvision", "timm"))


def require_library(lib: str):
    """`lib` imported, or this test skipped saying so; a failure instead under make test-eco
    (LARGEBATCH_REQUIRE_LIBRARIES), whose environment has timm and torchvision."""
    try:
        return __import__(lib)
    except ImportError as err:
        if os.environ.get("LARGEBATCH_REQUIRE_LIBRARIES"):
            pytest.fail(f"{lib} does not import in this environment ({err}), which make test-eco says has it")
        pytest.skip(f"{lib} does not import here ({err}); make test-eco runs this in an environment that has it")


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def one_thread():
    """Small tensors: one intra-op thread avoids thread hand-offs on a busy 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


UNIT = ROOT / "tests" / "unit"
UNIT_RULE = "a unit test starts no {} (tests/conftest.py); move the test to tests/integration/"


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """The tiers are folders: a test in tests/unit/ starts no process and no process group (tests/integration/
    holds those), so `make test-fast` is that folder, with no list to keep. Enforced here, for every unit test."""
    if UNIT not in request.node.path.parents:
        return
    import multiprocessing.process

    import torch.distributed as dist

    def refuse(what):
        def call(*args, **kwargs):
            raise AssertionError(UNIT_RULE.format(what))
        return call
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("process"))
    monkeypatch.setattr(dist, "init_process_group", refuse("process group"))


@pytest.fixture
def main(capsys):
    """Run `largebatch ARGS` in this process (a refusal costs no interpreter start); (exit code, the one error
    line, or all of stderr when there is not exactly one)."""
    from largebatch import cli as cli_mod

    def run(*args):
        code = cli_mod.main([str(a) for a in args])
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        lines = [line for line in err.splitlines() if line.startswith("largebatch: error:")]
        return code, (lines[0] if len(lines) == 1 else err)
    return run
