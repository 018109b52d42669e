"""Intra-op threads (largebatch.dist.set_threads, launch.local_workers): train.threads, else OMP_NUM_THREADS, else
this process's cores per local worker; never the machine's cores where the affinity gives fewer."""
from __future__ import annotations

import os

import pytest
import torch

from largebatch import dist, launch


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_follow_the_setting_then_the_environment_then_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)   # the machine's count: never read where an affinity exists
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert dist.set_threads(None, 2) == 2 == torch.get_num_threads()
    assert dist.set_threads(None, 8) == 1
    assert dist.set_threads(3, 2) == 3 == torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert dist.set_threads(None, 1) == 1 and dist.set_threads(2, 1) == 2
    for junk in ("0", "two", "", "-1"):   # not a whole number >= 1: the cores decide, as torch ignores it
        monkeypatch.setenv("OMP_NUM_THREADS", junk)
        assert dist.set_threads(None, 1) == 4


def test_the_launcher_gives_each_worker_its_share_of_this_process_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # recorded, so the launcher's setdefault below is undone after
    monkeypatch.delenv("OMP_NUM_THREADS")
    launch.local_workers(2, ["train"])
    assert os.environ["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # the user's (or the suite's) own setting is kept
    launch.local_workers(2, ["train"])
    assert os.environ["OMP_NUM_THREADS"] == "1"
