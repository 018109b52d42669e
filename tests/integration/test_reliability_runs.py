"""Checkpoint writes under SIGKILL, on real processes."""
import multiprocessing
import os
import random
import signal
import time

import pytest
import torch

from largebatch import checkpoint


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

