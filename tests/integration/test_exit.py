"""`largebatch.cli.exit_now`, the end of every `largebatch` process: what Python's exit does, less the finalization."""
import os
import subprocess
import sys

from conftest import ROOT


def _python(code: str, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}   # stdout block-buffered, as a user's
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True, timeout=120,
                          **({"capture_output": True} | kwargs))


def test_exit_now_flushes_runs_atexit_handlers_and_keeps_the_code():
    proc = _python("import atexit, sys\n"
                   "from largebatch.cli import exit_now\n"
                   "atexit.register(lambda: print('atexit ran'))\n"
                   "print('buffered', end='')\n"           # a pipe: block-buffered, flushed only at the exit
                   "sys.stderr.write('err, no newline')\n"
                   "exit_now(3)\n")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "bufferedatexit ran\n"
    assert proc.stderr == "err, no newline"


def test_output_that_cannot_be_written_is_an_error_not_a_success():
    """stdout on a full disk: as Python's own exit, code 120 and a line on stderr, not 0."""
    with open("/dev/full", "w") as full:
        proc = _python("from largebatch.cli import exit_now\nprint('x' * 100)\nexit_now(0)\n", stdout=full,
                       stderr=subprocess.PIPE, capture_output=False)
    assert proc.returncode == 120, proc.stderr
    assert proc.stderr.startswith("largebatch: error: writing the output failed") and "Traceback" not in proc.stderr


def test_exit_now_waits_for_a_thread_that_is_still_working(tmp_path):
    done = tmp_path / "done"
    proc = _python("import threading, time\n"
                   "from largebatch.cli import exit_now\n"
                   f"threading.Thread(target=lambda: (time.sleep(0.5), open({str(done)!r}, 'w').write('x'))).start()\n"
                   "exit_now(0)\n")
    assert proc.returncode == 0, proc.stderr
    assert done.read_text() == "x"


def test_the_program_exits_through_it_with_each_kind_of_code(cli):
    """`python -m largebatch`: a command's code, a user error's 2, argparse's --help 0 (its SystemExit)."""
    assert cli("train", "--help").returncode == 0
    assert cli("train", "--set", "optim.lr=-1", "--dry-run").returncode == 2
    proc = cli("config", "optim.lr")
    assert proc.returncode == 0 and "optim.lr" in proc.stdout
