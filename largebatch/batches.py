"""The batch source of the training loop: this rank's micro-batches for every optimizer step.

1. One shuffle per epoch, the same on every rank (`sampler.epoch_permutation`); each step takes its global
   batch from it in order, and each rank its contiguous slice (`sampler.rank_batch`), split into micro-batches.
2. It owns the loop's boundaries: a fresh loader at each epoch start, batch-phase change and Collapsed
   Ensemble collapse boundary (training augmentation off inside a collapse).
3. It starts from any step (a resume lands mid-epoch, mid-phase) and yields one step's micro-batches at a
   time, with the seconds spent waiting for them.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

from largebatch.data.sampler import epoch_permutation, rank_batch
from largebatch.schedule import Phase, Plan


class BatchSource:
    def __init__(self, plan: Plan, data, rank: int, world_size: int, seed: int):
        self.plan, self.data, self.rank, self.world_size, self.seed = plan, data, rank, world_size, seed

    def micro_batches(self, epoch: int, start: int, phase: Phase):
        """Step 1: this rank's micro-batch indices for the rest of `epoch` from step-in-epoch `start`."""
        perm = epoch_permutation(len(self.data), epoch, self.seed)
        for s in range(start, phase.steps_per_epoch):
            idx = rank_batch(perm, s, phase.global_batch, self.rank, self.world_size)
            yield from idx.split(phase.micro_batch)

    def steps(self, step: int, total: int) -> Iterator[tuple[Phase, list, float]]:
        """Steps 2-3: (phase, micro-batches, seconds waited) for steps `step`, `step` + 1, ... up to `total`;
        the caller takes exactly one optimizer step per item."""
        plan = self.plan
        while step < total:
            phase = plan.phase_at(step)
            epoch, in_epoch = plan.position(step)
            collapse = plan.in_collapse(step)
            batches = iter(self.data.batches(self.micro_batches(epoch, in_epoch, phase), train=not collapse,
                                             epoch=epoch))
            for _ in range(phase.steps_per_epoch - in_epoch):
                if step >= total or step >= phase.start_step + phase.steps or plan.in_collapse(step) != collapse:
                    break
                t0 = time.perf_counter()
                micros = [next(batches) for _ in range(phase.accumulation)]
                yield phase, micros, time.perf_counter() - t0
                step += 1
