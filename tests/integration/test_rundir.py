"""A run directory belongs to its run: refused without --resume, one writer at a time (a real flock held
by a real process), workers that stop when their launcher is SIGKILLed, no side effects on directories the
run did not create, and teardown with no thread of ours left behind."""
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from largebatch import checkpoint, launch, rundir
from largebatch.commands.chaos import _comm
from largebatch.errors import UserError

from conftest import ROOT, proc_alive, proc_holds, proc_ppid, user_error as _user_error

pytestmark = pytest.mark.timeout(300)

TINY = ["--set", "model.width=4", "--set", "data.dataset=synthetic", "--set", "data.synthetic_size=256",
        "--set", "data.image_size=8", "--set", "batch.global_batch=64", "--set", "schedule.epochs=1",
        "--set", "schedule.warmup_epochs=0", "--set", "train.plots=false", "--quiet"]


def _files(run: Path) -> dict:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_finished_run_is_refused_without_resume_and_left_as_it_was(cli, tmp_path):
    run = tmp_path / "run"
    done = cli("train", *TINY, "--run-dir", run, check=True)
    assert f"run directory {run}" in done.stderr and "plots in" not in done.stderr   # train.plots=false
    before = _files(run)
    # one process and two workers alike: one sentence naming --resume, nothing written
    _user_error(cli("train", *TINY, "--run-dir", run), "already holds a run", "--resume", "fresh --run-dir")
    _user_error(cli("train", *TINY, "--run-dir", run, "--nproc-per-node", "2"), "already holds a run")
    _user_error(cli("train", *TINY, "--run-dir", run, "--set", "optim.lr=0.2"), "already holds a run")
    assert _files(run) == before
    # a file where the run directory should be
    f = tmp_path / "file"
    f.write_text("mine")
    _user_error(cli("train", *TINY, "--run-dir", f), "is a file, not a directory")
    assert f.read_text() == "mine"


def test_resume_on_an_empty_directory_writes_its_config_so_evaluate_works(cli, tmp_path):
    run = tmp_path / "empty"
    run.mkdir()
    proc = cli("train", *TINY, "--run-dir", run, "--resume", check=True)
    assert "no checkpoint" in proc.stderr
    assert (run / "config.yaml").is_file() and (run / "summary.json").is_file()
    ev = cli("evaluate", run, check=True)
    assert json.loads(ev.stdout.strip().splitlines()[-1])["count"] > 0
    ev2 = cli("evaluate", run, "--nproc-per-node", "2")   # under the launcher: 0, and 2 for a user error
    assert ev2.returncode == 0, ev2.stderr
    assert json.loads(ev2.stdout.strip().splitlines()[-1])["world_size"] == 2
    bad = cli("evaluate", run, "--nproc-per-node", "2", "--checkpoint", tmp_path / "nope.pt")
    _user_error(bad, "nope.pt does not exist")


def test_a_second_writer_is_refused_while_the_first_runs(cli, tmp_path):
    """A real first run holds the lock; a second `--resume` on its directory is refused at once and
    the first run finishes untouched."""
    run = tmp_path / "run"
    # a second per step from step 2 on (the fault knob's hang), so the first run is still running however fast the
    # machine: a tiny run of 40 epochs could finish before the second writer came
    slow = {**os.environ, "LARGEBATCH_FAULTS": "hang@0:2-1000000", "LARGEBATCH_FAULT_HANG_S": "1"}
    first = subprocess.Popen([sys.executable, "-m", "largebatch", "train", *TINY, "--set", "schedule.epochs=40",
                              "--set", "train.log_every=1", "--run-dir", str(run)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=slow)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        t = time.monotonic()
        second = cli("train", *TINY, "--run-dir", run, "--resume")
        _user_error(second, "is in use by another largebatch process", f"pid {first.pid}")
        assert time.monotonic() - t < 60   # refused at once, not after waiting for the lock
        assert rundir.in_use(run)
    finally:
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=120)
    assert first.returncode == 143, err   # the first run stopped gracefully, at a checkpoint
    assert checkpoint.latest(run / "checkpoints") is not None
    assert not rundir.in_use(run)
    cli("train", *TINY, "--set", "schedule.epochs=40", "--set", "train.max_steps=6", "--run-dir", run,
        "--resume", check=True)   # and the run can be resumed once the first writer has gone


def test_workers_stop_at_a_checkpoint_when_their_launcher_is_sigkilled(cli, tmp_path):
    run = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "largebatch", "train", *TINY, "--set", "schedule.epochs=40",
                                 "--set", "train.log_every=1", "--nproc-per-node", "2", "--run-dir", str(run)],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + 150
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    workers = _workers_of(launcher.pid)
    assert len(workers) == 2
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 90
    while any(proc_alive(pid) for pid in workers):   # PR_SET_PDEATHSIG: SIGTERM -> stop at the next step
        assert time.monotonic() < deadline, "workers kept running after their launcher died"
        time.sleep(0.2)
    assert not rundir.in_use(run)
    assert checkpoint.latest(run / "checkpoints") is not None   # the graceful stop wrote a checkpoint
    assert not (run / "summary.json").exists()
    cli("train", *TINY, "--set", "schedule.epochs=40", "--set", "train.max_steps=8", "--run-dir", run,
        "--resume", check=True)


def test_workers_fork_from_their_launchers_forkserver_and_a_sigterm_ends_the_launch_by_itself(tmp_path):
    """A launch's workers are forked from a forkserver of its own (launch._launch_warm), itself a fork of the
    launcher, which had imported torch (launch.fork_forkserver), holding none of the launcher's files; each worker
    in a session of its own as torchrun starts them, named after its rank (what `largebatch chaos` reads), the
    forkserver in a session of its own (a signal to the launcher's group does not end it). SIGTERM to the launcher: the workers stop at a step
    boundary with a checkpoint and end by themselves (torch's agent SIGKILLs a worker still there 30 s after
    its SIGTERM: a finished worker used to wait for the agent there), exit 143, and nothing of the launch is left
    in its process group. Each of them has faulthandler's handlers, as under a spawned forkserver."""
    run = tmp_path / "run"
    held_r, held = os.pipe()   # a file of the launcher's own: neither its forkserver nor a worker may hold it
    launcher = subprocess.Popen([sys.executable, "-m", "largebatch", "train", *TINY, "--set", "schedule.epochs=40",
                                 "--set", "train.log_every=1", "--nproc-per-node", "2", "--run-dir", str(run)],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, pass_fds=(held,),
                                # one BLAS thread: numpy's OpenBLAS starts no pool at import, so the launcher
                                # has one thread and forks its forkserver (launch._fork_is_safe)
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})
    os.close(held)
    pipe = os.readlink(f"/proc/self/fd/{held_r}")
    deadline = time.monotonic() + 150
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read()[-3000:]
        time.sleep(0.1)
    from largebatch.commands.chaos import _workers

    assert sorted(_workers(launcher.pid).values()) == [(0, 0), (1, 0)]   # (rank, restart attempt) by process name
    workers = _workers_of(launcher.pid)
    assert all(os.getsid(pid) == pid for pid in workers)   # each in a session of its own, as torchrun starts them
    servers = {proc_ppid(pid) for pid in workers}
    assert len(servers) == 1 and proc_ppid(next(iter(servers))) == launcher.pid
    server = next(iter(servers))   # forked from the launcher, which had imported torch (launch.fork_forkserver)
    assert Path(f"/proc/{server}/comm").read_text().strip() == launch.FORKSERVER_NAME
    assert "libtorch_cpu.so" in Path(f"/proc/{server}/maps").read_text()
    assert os.getsid(server) == server != os.getsid(launcher.pid)   # a signal to the launcher's group misses it
    assert [proc_holds(pid, pipe) for pid in (launcher.pid, server, *workers)] == [True, False, False, False]
    # faulthandler's handlers (PYTHONFAULTHANDLER, as a spawned interpreter has them; torch's `record` enables it in
    # every worker): a fork that left it "enabled" with SIG_DFL dispositions made that enable a no-op
    assert all(_catches(pid, signal.SIGABRT) and _catches(pid, signal.SIGSEGV) for pid in (server, *workers))
    os.close(held_r)
    started = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 143, err[-3000:]
    assert time.monotonic() - started < 30, "a worker waited for the agent until its SIGKILL"
    if "checkpoint written" not in err or "Traceback" in err:
        pytest.fail(f"the launcher's stderr:\n{err[-6000:]}")   # whole, not an assertion's shortened diff
    with pytest.raises(ProcessLookupError):   # no forkserver, resource tracker or worker left in the group
        os.killpg(launcher.pid, 0)
    assert not any(proc_alive(pid) for pid in workers)


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for signal `sig` (/proc/PID/status SigCgt)."""
    caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (sig - 1) & 1)


def _workers_of(launcher: int) -> list[int]:
    """The launcher's workers, as `largebatch chaos` finds them (by rank: a forked worker's process name)."""
    from largebatch.commands.chaos import _workers

    return sorted(_workers(launcher))


def test_claim_keeps_modes_of_existing_directories_and_locks(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    claim = rundir.claim(shared, resume=False)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777      # sticky bit and mode untouched
    with pytest.raises(UserError, match="in use by another largebatch process"):
        rundir.claim(shared, resume=True)                      # a second open file description: refused
    claim.release()
    rundir.claim(shared, resume=True).release()
    new = tmp_path / "a" / "new"
    old_umask = os.umask(0)
    try:
        rundir.claim(new, resume=False).release()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(new.stat().st_mode) == 0o755          # a directory it creates: never world-writable
    (new / "train.log").write_text("a caller's log is no run")   # other files: test_run_dir_safety.py
    rundir.claim(new, resume=False).release()
    (new / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="already holds a run"):
        rundir.claim(new, resume=False)


def test_teardown_leaves_no_thread_of_ours(tmp_path, one_thread):
    """Trainer.close joins its threads; the watchdog's publisher is joined even while it is inside a
    (slow) store call: a daemon thread left inside native code at interpreter exit aborts the process."""
    import datetime

    import torch.distributed as dist

    from largebatch.reliability import Watchdog

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    dog = Watchdog(client, 0, 1, timeout_s=60.0, publish_every_s=0.0)
    big = "r" * (4 << 20)    # every publish is a 4 MB store call
    for step in range(50):
        dog.check_in(step, big + str(step))
    assert dog.close() is True
    assert not [t for t in threading.enumerate() if t.name == "largebatch-watchdog"]

    from largebatch.config import from_dict
    from largebatch.trainer import Trainer

    cfg = from_dict({"model": {"width": 4}, "data": {"dataset": "synthetic", "synthetic_size": 128, "image_size": 8},
                     "batch": {"global_batch": 32}, "schedule": {"epochs": 1, "warmup_epochs": 0},
                     "train": {"plots": False}})
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    trainer.fit()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("largebatch")]
    assert not rundir.in_use(tmp_path / "run")


def _cpp_log_level_of(pid: int) -> int:
    """c10's C++ log level in process `pid` (`launch.cpp_log_level`'s FLAGS_caffe2_log_level), read from its memory:
    the variable's offset in libc10.so (as this process has the library mapped) from that process's own mapping."""
    import ctypes

    def base(maps: str, lib: str) -> int:
        return min(int(line.split("-")[0], 16) for line in maps.splitlines() if line.endswith(lib))

    level = launch.cpp_log_level()
    lib = next(line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
               if line.endswith("/libc10.so"))
    offset = ctypes.addressof(level) - base(Path("/proc/self/maps").read_text(), lib)
    with open(f"/proc/{pid}/mem", "rb") as mem:
        mem.seek(base(Path(f"/proc/{pid}/maps").read_text(), lib) + offset)
        return int.from_bytes(mem.read(4), sys.byteorder, signed=True)


def test_an_agents_cpp_warnings_are_off_and_its_workers_are_not(tmp_path, monkeypatch):
    """`python -m largebatch.launch` (each host's agent under `emulate hosts`): the agent imports torch as its
    workers do, then raises its own C++ log level to ERROR (a store call to a node that has ended logs 40 lines of
    stack frames); its forkserver, a fork of it, and the workers get the level their import gives (WARNING, 1),
    read from each process's memory."""
    run = tmp_path / "run"
    # the torchrun arguments of a local launch (launch.local_workers: a store on a port of its own, a run id of its
    # own); one BLAS thread, so the agent forks its forkserver (set here: local_workers leaves a set value alone)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    agent = subprocess.Popen([sys.executable, "-m", "largebatch.launch",
                              *launch.local_workers(1, ["train", *TINY, "--set", "schedule.epochs=40",
                                                        "--set", "train.log_every=1", "--run-dir", str(run)])],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
            assert agent.poll() is None and time.monotonic() < deadline, agent.stderr.read()[-3000:]
            time.sleep(0.1)
        (worker,) = _workers_of(agent.pid)
        server = proc_ppid(worker)
        assert proc_ppid(server) == agent.pid and _comm(server) == launch.FORKSERVER_NAME
        assert [_cpp_log_level_of(pid) for pid in (agent.pid, server, worker)] == [2, 1, 1]
    finally:
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=120)
    assert agent.returncode == 143 and "Traceback" not in err, err[-3000:]
