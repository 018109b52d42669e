"""One optimizer step of synchronous data-parallel SGD (Goyal et al.), the part of the training loop that
touches tensors.

1. Set the step's lr on every parameter group; clear the gradients.
2. Run the step's micro-batches: each one's loss summed over its images and divided by the per-worker batch,
   so that DDP's average over workers normalises the gradient by the global batch; DDP's `no_sync()` on all
   but the last (gradient accumulation), autocast in the run's precision, the loss scaled under fp16.
3. On a logging step with `train.noise_scale`, the last micro-batch also skips DDP's all-reduce and
   `noise_scale.allreduce_with_norms` averages the gradients itself, measuring both norms on the way.
4. Unscale (LARS and every norm see fp32 gradients), then one finiteness verdict on the all-reduced
   gradients: the one host sync of a step. Every rank reaches the same verdict with no communication.
5. Step the optimizer (GradScaler steps and lowers its scale itself), update the EMA model; count a
   non-finite step, and stop the run with a UserError after `train.max_nonfinite` in a row.
"""
from __future__ import annotations

import contextlib
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from largebatch.errors import UserError
from largebatch.layout import autocast, resize_batch, to_model_layout
from largebatch.progress import Progress


class TrainStep:
    """Steps 1-5 over the parts a trainer builds; call it with the step's micro-batches."""

    def __init__(self, *, model: nn.Module, ddp: nn.Module, forward, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler, ema, noise, faults, device: torch.device, world_size: int,
                 precision: str, channels_last: bool, label_smoothing: float, log_every: int, max_nonfinite: int,
                 progress: Progress):
        self.model, self.ddp, self.forward, self.optimizer = model, ddp, forward, optimizer
        self.scaler, self.ema, self.noise, self.faults = scaler, ema, noise, faults
        self.device, self.world_size, self.distributed = device, world_size, world_size > 1
        self.precision, self.channels_last, self.label_smoothing = precision, channels_last, label_smoothing
        self.log_every, self.max_nonfinite, self.progress = log_every, max_nonfinite, progress
        self.nonfinite_run = 0     # consecutive non-finite steps
        self.noise_rec: dict = {}  # the last measurement of the noise scale, for the next log record

    def to_device(self, x: torch.Tensor, y: torch.Tensor, size: int | None = None):
        x = to_model_layout(x, self.device, self.channels_last)
        if size is not None and tuple(x.shape[-2:]) != (size, size):
            x = resize_batch(x, size, self.channels_last)
        return x, y.to(self.device, non_blocking=True)

    def __call__(self, step: int, micros: list[tuple[torch.Tensor, torch.Tensor]], phase, lr: float,
                 size: int | None = None) -> torch.Tensor:
        """Steps 1-5 for optimizer step `step`; the sum of the micro-batches' losses (on the device)."""
        for group in self.optimizer.param_groups:                                        # 1
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        measure = self.noise is not None and (step + 1) % self.log_every == 0            # 3
        ddp = cast(nn.parallel.DistributedDataParallel, self.ddp)   # the DDP module when distributed
        for i, (x, y) in enumerate(micros):                                              # 2
            x, y = self.to_device(x, y, size)
            last = i == len(micros) - 1 and not measure
            sync = contextlib.nullcontext() if (last or not self.distributed) else ddp.no_sync()
            with sync:
                with autocast(self.device, self.precision):
                    logits = self.forward(x)
                loss = F.cross_entropy(logits.float(), y, reduction="sum",
                                       label_smoothing=self.label_smoothing) / phase.per_worker_batch
                if self.faults.poison(step):   # LARGEBATCH_FAULTS=nan@RANK:STEP (debugging knob)
                    loss = loss * float("nan")
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        if measure:
            from largebatch.noise_scale import allreduce_with_norms

            small_sq, big_sq = allreduce_with_norms(
                [p.grad for p in self.model.parameters() if p.grad is not None], self.world_size,
                scale=self.scaler.get_scale() if self.scaler.is_enabled() else 1.0)
            self.noise_rec = self.noise.update(small_sq, big_sq, phase.per_worker_batch, phase.global_batch)
        self.scaler.unscale_(self.optimizer)                                             # 4
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        # a non-finite loss on any rank makes the reduced gradients non-finite too; the local loss is not
        # part of the verdict, as ranks could disagree on it
        norms = torch._foreach_norm(grads) if grads else [torch.zeros((), device=self.device)]
        ok = bool(torch.isfinite(torch.stack(norms).sum()).item())
        if self.scaler.is_enabled():                                                     # 5
            self.scaler.step(self.optimizer)   # skips the step itself on inf/nan
            self.scaler.update()               # and lowers the loss scale
        elif ok:
            self.optimizer.step()
        if ok:
            self.nonfinite_run = 0
            if self.ema is not None:
                self.ema.update_parameters(self.model)
        else:
            self.progress.nonfinite_total += 1
            self.nonfinite_run += 1
            if self.nonfinite_run > self.max_nonfinite:
                raise UserError(f"training diverged: {self.nonfinite_run} consecutive steps with non-finite loss or "
                                f"gradients at step {step}; lower optim.lr, lengthen schedule.warmup_epochs "
                                "or use optim.name=lars.")
        return loss_sum
