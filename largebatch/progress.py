"""A run's counters that survive a resume, checkpointed as the `progress` entry (the optimizer step is the
checkpoint's own `step`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    best_top1: float = 0.0
    nonfinite_total: int = 0      # steps skipped for a non-finite loss or gradient
    wall_before: float = 0.0      # training wall time of earlier sessions
    images_seen: int = 0
    train_time: float = 0.0       # seconds in training steps (data wait included), for images/s

    def state_dict(self, session_wall: float) -> dict:
        return {"best_top1": self.best_top1, "nonfinite_total": self.nonfinite_total,
                "wall_s": self.wall_before + session_wall, "images_seen": self.images_seen,
                "train_time": self.train_time}

    def load_state_dict(self, state: dict) -> None:
        self.best_top1 = state["best_top1"]
        self.nonfinite_total = state["nonfinite_total"]
        self.wall_before = state["wall_s"]
        self.images_seen = state["images_seen"]
        self.train_time = state["train_time"]
