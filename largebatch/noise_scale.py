"""The gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
arXiv 1812.06162), measured for almost nothing by data parallelism.

The simple noise scale B_simple = tr(Sigma) / |G|^2 (Sigma the per-example gradient covariance, G the true
gradient) predicts the critical batch: below it a larger batch trains proportionally faster, above it
returns diminish. Data parallelism computes two gradients per step anyway:

1. g_small: each worker's gradient over its own B_small images (before the all-reduce); |g_small|^2 is
   averaged over the workers (one extra scalar all-reduce). E|g_small|^2 = |G|^2 + tr(Sigma) / B_small.
2. g_big: the all-reduced gradient over B_big = workers x B_small images. E|g_big|^2 = |G|^2 + tr(Sigma) / B_big.
3. Unbiased estimates (the paper's appendix A.1):
       |G|^2    ~ (B_big |g_big|^2 - B_small |g_small|^2) / (B_big - B_small)
       tr(Sigma) ~ (|g_small|^2 - |g_big|^2) / (1 / B_small - 1 / B_big)
4. Their ratio is biased and noisy step to step, so each is averaged (an exponential moving average, or a
   plain mean over a window) before dividing.

The trainer measures on logging steps only (`train.noise_scale: true`, world size >= 2): that step's last
micro-batch runs without DDP's all-reduce, `allreduce_with_norms` averages the gradients itself and returns
both squared norms, and `NoiseScale` keeps the averages. Every rank gets the same figures.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def estimates(small_sq: float, big_sq: float, b_small: float, b_big: float) -> tuple[float, float]:
    """Step 3: (|G|^2, tr(Sigma)) from one pair of squared norms."""
    if b_big <= b_small:
        raise ValueError(f"B_big ({b_big}) must exceed B_small ({b_small}): the noise scale needs 2+ workers.")
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


@torch.no_grad()
def allreduce_with_norms(grads: list[torch.Tensor], world_size: int, scale: float = 1.0,
                         group: dist.ProcessGroup | None = None) -> tuple[float, float]:
    """Steps 1-2: average `grads` (each worker's own) over the workers in place; (mean over workers of the
    local |g|^2, |averaged g|^2), both divided by `scale`^2 (a loss scale the gradients still carry)."""
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    local = flat.pow(2).sum().reshape(1)
    dist.all_reduce(flat, group=group)
    dist.all_reduce(local, group=group)
    flat /= world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()
    norms = torch.stack([local[0] / world_size, flat.pow(2).sum()]).double() / (scale * scale)
    small_sq, big_sq = norms.tolist()
    return small_sq, big_sq


class NoiseScale:
    """Step 4: exponential moving averages of |G|^2 and tr(Sigma); B_simple from their ratio."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.g2: float | None = None
        self.trace: float | None = None

    @classmethod
    def for_run(cls, distributed: bool, main: bool) -> NoiseScale | None:
        """The run's averages, or None (with a warning from the main process) for a single worker."""
        if distributed:
            return cls()
        if main:
            import sys

            print("largebatch: warning: train.noise_scale needs 2 or more workers (it compares each worker's "
                  "gradient with the all-reduced one); not measured in this run.", file=sys.stderr)
        return None

    def update(self, small_sq: float, big_sq: float, b_small: float, b_big: float) -> dict:
        g2, trace = estimates(small_sq, big_sq, b_small, b_big)
        if self.g2 is None or self.trace is None:   # both None before the first measurement
            self.g2, self.trace = g2, trace
        else:
            self.g2 = self.decay * self.g2 + (1 - self.decay) * g2
            self.trace = self.decay * self.trace + (1 - self.decay) * trace
        b_simple = self.trace / self.g2 if self.g2 > 0 else float("inf")
        return {"noise_scale": b_simple, "grad_sq": self.g2, "grad_trace": self.trace}

    def state_dict(self) -> dict:
        return {"g2": self.g2, "trace": self.trace}

    def load_state_dict(self, state: dict) -> None:
        self.g2, self.trace = state.get("g2"), state.get("trace")
