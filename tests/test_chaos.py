"""`largebatch chaos`'s own bookkeeping, with real processes and real files: which kills cut a checkpoint write,
and how many steps each resume lost. Its end-to-end claims (the run survives, same final top-1) are the fault
tests' (test_faults.py) and docs/reliability.md's chaos run."""
import signal
import subprocess
import threading
import time
from pathlib import Path

from largebatch.commands.chaos import RESUMED, _kill_in_checkpoint_write, steps_lost
from largebatch.metrics import MetricsLog


def _sleepers(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["sleep", "60"]) for _ in range(n)]


def test_a_temporary_file_left_by_an_earlier_kill_is_not_a_write(tmp_path):
    """A `.tmp-*` left in checkpoints/ by an earlier kill (the writer removes such files only after a minute) must
    not count as a write: the kill waits for a new one, and reports in_write only for that one."""
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / ".tmp-step-00000060.pt-1234").write_bytes(b"half a checkpoint")   # left by an earlier kill
    launcher, writer = _sleepers(2)
    try:
        t0 = time.monotonic()
        assert _kill_in_checkpoint_write(launcher, ckpt, writer.pid, timeout=0.5) is False   # no new write came
        assert time.monotonic() - t0 >= 0.5
        assert writer.wait(timeout=10) == -signal.SIGKILL   # killed anyway, at the timeout

        writer = _sleepers(1)[0]
        new = ckpt / ".tmp-step-00000070.pt-999"
        timer = threading.Timer(0.3, new.write_bytes, args=(b"a write in progress",))
        timer.start()
        t0 = time.monotonic()
        assert _kill_in_checkpoint_write(launcher, ckpt, writer.pid, timeout=10) is True
        assert time.monotonic() - t0 >= 0.29   # not at once on the stale file: when the new one appeared
        assert writer.wait(timeout=10) == -signal.SIGKILL
    finally:
        for p in (launcher, writer):
            p.kill()
            p.wait()


def _metrics(path: Path, steps: list[int]) -> Path:
    log = MetricsLog(path)
    for s in steps:
        log.write({"kind": "train", "step": s, "epoch": s / 100, "loss": 1.0})
    log.write({"kind": "eval", "step": steps[-1], "top1": 0.5})
    log.close()
    return path


def test_every_resume_has_its_steps_lost_zero_included(tmp_path):
    """Resumes from 40 (step 43 logged before the kill: 3 lost), 50 (60: 10 lost) and 70 (70 logged last: none
    lost, and nothing in metrics.jsonl shows it) give [3, 10, 0], one per resume; a counter that went back to 1
    without a resume in the log (a restart from scratch) is listed after them."""
    steps = [*range(1, 44), *range(41, 61), *range(51, 101)]
    assert steps_lost(_metrics(tmp_path / "a.jsonl", steps), [40, 50, 70]) == [3, 10, 0]
    assert steps_lost(_metrics(tmp_path / "b.jsonl", steps + list(range(1, 5))), [40, 50, 70]) == [3, 10, 0, 100]
    log = ("largebatch: resumed from /r/checkpoints/step-00000040.pt at step 40.\nlargebatch: error: ...\n"
           "largebatch: resumed from /r/step 7/checkpoints/step-00000070.pt at step 70.\n")
    assert [int(m) for m in RESUMED.findall(log)] == [40, 70]
