"""The run plan: how a run's global batch becomes work on each device, decided in one place.

`decide` goes, for a config, a world and a device:
1. the device's memory and what the run needs of it (largebatch/memory.py steps 1-4: the state, the bytes per
   image, the margin, what else the GPU holds);
2. the forward cap: the micro-batch that `batch.micro_batch: auto` resolves to (memory.py step 5), None where
   the recipe fixes the split itself;
3. every batch phase's per-worker batch split into the fewest equal micro-batches of at most the cap, the
   accumulation that follows, its steps per epoch and its lr (`schedule.Plan`; the split rule is
   `schedule.split_batch` alone).
The trainer, `largebatch train --dry-run` and `largebatch plan` all call it, so they agree on every figure they
share (steps per epoch, micro-batch, accumulation, memory): tests/unit/test_runplan.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from largebatch import memory
from largebatch.schedule import Plan


@dataclass(frozen=True)
class RunPlan:
    schedule: Plan                     # step 3: phases (micro-batch, accumulation, steps per epoch), lr per step
    estimate: memory.Estimate | None   # step 1; None where the model does not run on the meta device
    micro_cap: int | None              # step 2

    @property
    def largest_micro_batch(self) -> int:
        return max(p.micro_batch for p in self.schedule.phases)

    def fits(self) -> bool:
        """Whether the largest forward batch of any phase fits the device (unknown counts as fitting)."""
        return self.estimate is None or self.estimate.need(self.largest_micro_batch) <= self.estimate.device_bytes

    def how(self, cfg) -> str:
        """How the micro-batch was decided, in a phrase."""
        if self.micro_cap is not None:
            return "batch.micro_batch auto: the largest micro-batch whose memory fits, the per-worker batch split evenly"
        return f"batch.micro_batch {cfg.batch.micro_batch}, batch.accumulation {cfg.batch.accumulation}"

    def auto_split(self) -> str | None:
        """The sentence a run says when `auto` split a batch into micro-batches; None where it did not."""
        split = [p for p in self.schedule.phases if p.accumulation > 1]
        if self.micro_cap is None or self.estimate is None or not split:
            return None
        p = split[0]
        return (f"batch.micro_batch auto: {p.per_worker_batch} images per worker as {p.accumulation} micro-batches "
                f"of {p.micro_batch} (the global batch and lr unchanged; BatchNorm normalises each micro-batch): "
                f"{self.estimate.describe(p.micro_batch)}.")


def decide(cfg, info, *, world_size: int, local_workers: int, train_size: int, device_type: str,
           device: torch.device | None = None, device_memory: tuple[int, str] | None = None) -> RunPlan:
    """Steps 1-3 for a run of `cfg` on `world_size` workers, `local_workers` of them per host, over `train_size`
    images of the data `info` describes. `device`: the rank's own device in a run (its free memory is read);
    None for a plan made before the run (a dry run, `largebatch plan`). `device_memory`: (bytes, where from) of a
    device that is not this machine's (`largebatch plan`'s catalog entry)."""
    micro_cap, est = memory.resolve(cfg, info, world_size=world_size, local_workers=local_workers,
                                    device_type=device_type, device=device, given=device_memory)
    schedule = Plan(cfg.batch, cfg.optim, cfg.schedule, world_size=world_size, train_size=train_size,
                    ensemble_cfg=cfg.ensemble, micro_cap=micro_cap)
    return RunPlan(schedule, est, micro_cap)
