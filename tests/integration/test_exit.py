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


def test_shutdown_never_frees_a_group_while_python_holds_the_gil():
    """`largebatch.dist.shutdown` keeps every group it destroys (`_kept_groups`) until the process's os._exit. A
    group freed from Python runs ProcessGroupGloo's destructor with the GIL held, and it joins gloo's worker
    threads (pt_gloo_runloop), one of which may be waiting for that GIL to release a finished work's tensors: a
    rank that never ended. Seen here: gloo's threads outlive the shutdown, and the group's objects (the default
    group and a subgroup, after an all-gather on each) are the ones kept. Plain torch's destroy_process_group
    frees the group at once: its threads are joined (the control case, in the same process first)."""
    code = (
        "import os, time, torch, torch.distributed as td\n"
        "from largebatch import dist as d\n"
        "from largebatch.launch import free_port\n"
        "def gloo_threads():\n"
        "    return sum(open(f'/proc/self/task/{t}/comm').read().strip() == 'pt_gloo_runloop'\n"
        "               for t in os.listdir('/proc/self/task'))\n"
        "def start():\n"
        "    td.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "    sub = td.new_group([0])\n"
        "    for group in (None, sub):\n"
        "        out = [torch.zeros(3)]\n"
        "        td.all_gather(out, torch.ones(3), group=group)\n"
        "    deadline = time.monotonic() + 20   # a thread is named pt_gloo_runloop once it has started running\n"
        "    while gloo_threads() < 4 and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    return td.group.WORLD, sub\n"
        "start()\n"
        "running = gloo_threads()\n"
        "td.destroy_process_group()\n"
        "print('plain', running, gloo_threads())\n"
        "world, sub = start()\n"
        "running = gloo_threads()\n"
        "d.shutdown(barrier=True, timeout_s=30)\n"
        "kept = [any(g is x for x in d._kept_groups) for g in (world, sub)]\n"
        "del world, sub\n"
        "print('largebatch', running, gloo_threads(), kept)\n"
        "d.end_process(0)\n")
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    plain, ours = proc.stdout.splitlines()
    assert int(plain.split()[1]) >= 4 and plain.split()[2] == "0", proc.stdout   # 2 threads per group
    name, running, after, kept = ours.split(" ", 3)
    assert int(running) >= 4 and after == running and kept == "[True, True]", proc.stdout
