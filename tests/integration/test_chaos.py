"""`largebatch chaos`'s own bookkeeping, with real processes and real files: which kills cut a checkpoint write,
and how many steps each resume lost. Its end-to-end claims (the run survives, same final top-1) are the fault
tests' (test_faults.py) and docs/reliability.md's chaos run."""
import signal
import subprocess
import threading
import time
from pathlib import Path

from largebatch.commands.chaos import RESUMED, _kill_in_checkpoint_write, _wait_gone, steps_lost
from largebatch.metrics import MetricsLog


def _sleepers(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["sleep", "60"]) for _ in range(n)]


def test_a_kill_in_a_checkpoint_write_waits_for_a_new_write_of_the_writer(tmp_path):
    """A `.tmp-*` of a step left in checkpoints/ by an earlier kill (the writer removes such files only after a
    minute) and the manifest's temporary file (rewritten after a checkpoint completes) are not a write: the kill
    waits for a new data or metadata file of a step with the writer's pid. It cut the write when that step has no
    metadata once the writer is gone."""
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    launcher, writer = _sleepers(2)
    (ckpt / f".tmp-step-00000060.pt-{writer.pid}").write_bytes(b"half a checkpoint")   # left by an earlier kill
    try:
        manifest = threading.Timer(0.1, (ckpt / f".tmp-.largebatch-written-{writer.pid}").write_bytes, args=(b"x",))
        manifest.start()
        t0 = time.monotonic()
        assert _kill_in_checkpoint_write(launcher, ckpt, writer.pid, timeout=0.5) == (False, False)   # none came
        assert time.monotonic() - t0 >= 0.5
        assert writer.wait(timeout=10) == -signal.SIGKILL   # killed anyway, at the timeout

        for step, complete in ((70, False), (80, True)):
            writer = _sleepers(1)[0]
            if complete:   # the metadata is in place: the kill came after the write
                (ckpt / f"step-{step:08d}.json").write_text("{}")
            timer = threading.Timer(0.3, (ckpt / f".tmp-step-{step:08d}.pt-{writer.pid}").write_bytes,
                                    args=(b"a write in progress",))
            timer.start()
            t0 = time.monotonic()
            assert _kill_in_checkpoint_write(launcher, ckpt, writer.pid, timeout=10) == (True, not complete)
            assert time.monotonic() - t0 >= 0.29   # not at once on the stale file: when the new one appeared
            assert writer.wait(timeout=10) == -signal.SIGKILL
    finally:
        for p in (launcher, writer):
            p.kill()
            p.wait()


def test_a_process_is_gone_once_it_is_a_zombie(tmp_path):
    """`_wait_gone` returns when the killed writer is a zombie (not yet reaped), and waits while it runs."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        t0 = time.monotonic()
        _wait_gone(proc.pid, timeout=0.3)
        assert time.monotonic() - t0 >= 0.3   # still running: waited out the timeout
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _wait_gone(proc.pid, timeout=30)
        assert time.monotonic() - t0 < 30 and proc.poll() == -signal.SIGKILL   # a zombie until poll() reaped it
    finally:
        proc.kill()
        proc.wait()


def _metrics(path: Path, steps: list[int]) -> Path:
    log = MetricsLog(path)
    for s in steps:
        log.write({"kind": "train", "step": s, "epoch": s / 100, "loss": 1.0})
    log.write({"kind": "eval", "step": steps[-1], "top1": 0.5})
    log.close()
    return path


def test_every_resume_has_its_steps_lost_zero_included(tmp_path):
    """Resumes from 40 (step 43 logged before the kill: 3 lost), 50 (60: 10 lost) and 70 (70 logged last: none
    lost, and nothing in metrics.jsonl shows it) give [3, 10, 0], one per resume. A counter that went back to 1
    without a resume in the log (a restart from scratch) is listed apart, also when it comes between resumes."""
    steps = [*range(1, 44), *range(41, 61), *range(51, 101)]
    assert steps_lost(_metrics(tmp_path / "a.jsonl", steps), [40, 50, 70]) == ([3, 10, 0], [])
    assert steps_lost(_metrics(tmp_path / "b.jsonl", steps + list(range(1, 5))), [40, 50, 70]) == ([3, 10, 0], [100])
    scratch = [*range(1, 44), *range(1, 61), *range(51, 101)]   # 43 -> 1 with no resume, then a resume from 50
    assert steps_lost(_metrics(tmp_path / "c.jsonl", scratch), [50]) == ([10], [43])
    log = ("largebatch: resumed from /r/checkpoints/step-00000040.pt at step 40.\nlargebatch: error: ...\n"
           "largebatch: resumed from /r/step 7/checkpoints/step-00000070.pt at step 70.\n")
    assert [int(m) for m in RESUMED.findall(log)] == [40, 70]
