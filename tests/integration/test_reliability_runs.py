"""Checkpoint writes under SIGKILL, on real processes."""
import multiprocessing
import os
import random
import signal
import time

import pytest
import torch

from largebatch import checkpoint

from conftest import proc_stat


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(512, 1024, generator=g), "step": step}


def _writer(directory: str, start: int) -> None:
    step = start
    while True:
        checkpoint.save(_state(step % 7), __import__("pathlib").Path(directory), step, keep=2)
        step += 1


@pytest.mark.timeout(120)
def test_sigkill_during_checkpoint_writes_never_leaves_a_bad_checkpoint(tmp_path):
    """A real writer process SIGKILLed 8 times at random moments (mostly inside writes: it does nothing else)."""
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    start = 0
    for kill in range(8):
        proc = ctx.Process(target=_writer, args=(str(tmp_path), start), daemon=True)
        proc.start()
        time.sleep(0.3 + rng.random() * 0.4)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        metas = sorted(tmp_path.glob("step-*.json"))
        for meta in metas:      # every checkpoint with metadata is complete and loads
            ok = checkpoint.verify(meta)
            assert ok is not None, f"kill {kill}: {meta.name} is not intact"
            state = checkpoint.load(meta.with_suffix(".pt"))
            assert torch.equal(state["w"], _state(ok["step"] % 7)["w"])
        found = checkpoint.latest(tmp_path, warn=lambda m: pytest.fail(m))
        assert found is not None
        start = found[1]["step"] + 1
    assert start > 8   # the writer made progress between kills
    assert len(list(tmp_path.glob("step-*.json"))) <= 3



def test_a_hung_runs_report_lists_its_processes_and_makes_them_write_their_stacks():
    """chaos.hung_report (the suite's and stress_teardown.py's report on a run that did not end): a process and its
    child are listed, the process with its state, and the SIGABRT makes the one with faulthandler on write its
    stack (here, its sleep) before it ends."""
    import subprocess
    import sys

    from largebatch.commands.chaos import hung_report

    code = ("import faulthandler, subprocess, sys, time\n"
            "faulthandler.enable()\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    deadline = time.monotonic() + 20   # "ready" is printed before the sleep starts: until then the state reads R
    while proc_stat(proc.pid)[0] != "S" and time.monotonic() < deadline:
        time.sleep(0.05)
    report = hung_report(proc.pid)
    _, err = proc.communicate(timeout=30)
    rows = report.splitlines()[1:]
    assert [int(r.split()[0]) for r in rows][:1] == [proc.pid] and len(rows) == 2, report
    assert rows[0].split()[2:4] == ["python", "S"], report   # asleep in time.sleep
    assert int(rows[1].split()[1]) == proc.pid, report   # its child, however far its start-up had come
    assert proc.returncode == -6 and "Fatal Python error: Aborted" in err and "<module>" in err, err
