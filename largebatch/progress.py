"""A run's counters: those that survive a resume (`Progress`, checkpointed as the `progress` entry; the
optimizer step is the checkpoint's own `step`), and the training log's window between two logging steps
(`LogWindow`)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Progress:
    best_top1: float = 0.0
    nonfinite_total: int = 0      # steps skipped for a non-finite loss or gradient
    wall_before: float = 0.0      # training wall time of earlier sessions
    images_seen: int = 0
    train_time: float = 0.0       # seconds in training steps (data wait included), for images/s
    # the decay's stretches by resumes that changed its length (schedule.Plan.stretches): [epoch, old, new horizon]
    lr_stretches: list | None = None

    def state_dict(self, session_wall: float) -> dict:
        return {"best_top1": self.best_top1, "nonfinite_total": self.nonfinite_total,
                "wall_s": self.wall_before + session_wall, "images_seen": self.images_seen,
                "train_time": self.train_time, "lr_stretches": [list(map(float, s)) for s in self.lr_stretches or []]}

    def load_state_dict(self, state: dict) -> None:
        self.best_top1 = state["best_top1"]
        self.nonfinite_total = state["nonfinite_total"]
        self.wall_before = state["wall_s"]
        self.images_seen = state["images_seen"]
        self.train_time = state["train_time"]
        self.lr_stretches = [tuple(s) for s in state.get("lr_stretches", [])]   # none in an older checkpoint


class LogWindow:
    """Sums between two logging steps: the loss stays on the device (no host sync per step), the seconds
    waited for data, and where the window began (time, images seen, step)."""

    def __init__(self, device: torch.device, step: int, images_seen: int):
        self.loss = torch.zeros((), device=device)
        self.data_wait = 0.0
        self.start = (time.perf_counter(), images_seen, step)

    def close(self, step: int, images_seen: int, world_size: int) -> dict:
        """The window's mean loss over steps and workers (one all-reduce: every rank calls it), images/s and
        data wait per step; a new window begins."""
        t0, images0, step0 = self.start
        n = max(step - step0, 1)
        loss = self.loss / n
        if world_size > 1:
            dist.all_reduce(loss)
            loss /= world_size
        now = time.perf_counter()
        rec = {"loss": float(loss), "images_per_s": (images_seen - images0) / max(now - t0, 1e-9),
               "data_wait_s": self.data_wait / n}
        self.loss.zero_()
        self.data_wait = 0.0
        self.start = (now, images_seen, step)
        return rec
