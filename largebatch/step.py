"""One optimizer step of synchronous data-parallel SGD (Goyal et al.), the part of the training loop that
touches tensors.

1. Set the step's lr on every parameter group; clear the gradients: set to None, so the first micro-batch's
   backward writes them with no zeroing kernel, except where they are DDP's bucket views
   (`gradient_as_bucket_view`, largebatch/dist.py wrap_ddp) or a CUDA graph's static tensors: those are zeroed
   in place (`optim.zero_grads`, one multi-tensor kernel). A bucket view set to None is gone: the next backward
   allocates a fresh gradient and DDP's reducer copies it into the bucket, every step.
2. Run the step's micro-batches: each one's loss summed over its images and divided by the per-worker batch,
   so that DDP's average over workers normalises the gradient by the global batch; DDP's `no_sync()` on all
   but the last (gradient accumulation), autocast in the run's precision, the loss scaled under fp16.
3. On a logging step with `train.noise_scale`, the last micro-batch also skips DDP's all-reduce and
   `noise_scale.allreduce_with_norms` averages the gradients itself, measuring both norms on the way.
4. Unscale (LARS and every norm see fp32 gradients), then one finiteness verdict on the all-reduced
   gradients, kept on the device: `found_inf`. Every rank reaches the same verdict with no communication.
5. Step the optimizer with that verdict (largebatch.optim.skip: a non-finite step changes nothing), lower
   the fp16 loss scale on it (GradScaler.update), update the EMA model unless skipped, and count the
   skipped steps, all on the device. The step makes no host sync: `check()`, on logging steps, reads the
   counts and stops the run with a UserError when more than `train.max_nonfinite` steps in a row were
   skipped, naming the step where that happened.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from largebatch.errors import UserError
from largebatch.placement import autocast, resize_batch, to_model_layout
from largebatch.optim import update_ema, zero_grads
from largebatch.progress import Progress

if TYPE_CHECKING:
    from largebatch.graph import GraphedStep

# The device counters of step 5, one int64 vector: skipped steps since the last check, the current run of
# consecutive skipped steps, the step at which that run first exceeded max_nonfinite (-1: never), the step.
TOTAL, RUN, DIVERGED_AT, STEP = range(4)



class Diverged(UserError):
    """Training diverged (more than train.max_nonfinite consecutive non-finite steps): a result of the settings,
    said in one sentence; the trainer records it as the run's status (summary.json, status "diverged")."""

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
        self.counters: torch.Tensor | None = None   # step 5's counters, made at the first step
        self.noise_rec: dict = {}  # the last measurement of the noise scale, for the next log record
        self.graph: GraphedStep | None = None   # the CUDA graph of steps 2-5 (largebatch/graph.py), set by the trainer
        self.forward_cap: int | None = None   # split micro-batches further after an out-of-memory retry (memory.py 6)
        # step 1: the gradients are DDP's bucket views, kept by zeroing them in place
        self.bucket_views = bool(getattr(ddp, "gradient_as_bucket_view", False))

    def to_device(self, x: torch.Tensor, y: torch.Tensor, size: int | None = None):
        x = to_model_layout(x, self.device, self.channels_last)
        if size is not None and tuple(x.shape[-2:]) != (size, size):
            x = resize_batch(x, size, self.channels_last)
        return x, y.to(self.device, non_blocking=True)

    def __call__(self, step: int, micros: list[tuple[torch.Tensor, torch.Tensor]], phase, lr: float,
                 size: int | None = None) -> torch.Tensor:
        """Steps 1-5 for optimizer step `step`; the sum of the micro-batches' losses (on the device). With a
        CUDA graph (`self.graph`, largebatch/graph.py) steps 2, 4 and 5 are replayed, except on the noise
        scale's measuring steps."""
        measure = self.noise is not None and (step + 1) % self.log_every == 0            # 3
        set_lr(self.optimizer, lr, static=self.graph is not None)                        # 1
        if self.graph is not None and not measure:
            return self.graph(step, micros, phase, size)
        if self.bucket_views:
            zero_grads(self.optimizer)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return self.body(step, micros, phase, size, self.faults.poison(step), measure)

    def body(self, step: int, micros: list[tuple[torch.Tensor, torch.Tensor]], phase, size: int | None,
             poison: bool | torch.Tensor, measure: bool = False) -> torch.Tensor:
        """Steps 2-5 (what a CUDA graph holds): the micro-batches' forward and backward, the verdict, the update.
        `poison` (the LARGEBATCH_FAULTS debugging knob) multiplies the loss by NaN: a bool, or in a graph a
        device scalar of 1 or NaN."""
        loss_sum = torch.zeros((), device=self.device)
        ddp = cast(nn.parallel.DistributedDataParallel, self.ddp)   # the DDP module when distributed
        cap = self.forward_cap
        if cap is not None:   # the same images in smaller forward passes: each loss is still / per_worker_batch
            micros = [(x[i:i + cap], y[i:i + cap]) for x, y in micros for i in range(0, len(y), cap)]
        for i, (x, y) in enumerate(micros):                                              # 2
            x, y = self.to_device(x, y, size)
            last = i == len(micros) - 1 and not measure
            sync = contextlib.nullcontext() if (last or not self.distributed) else ddp.no_sync()
            with sync:
                with autocast(self.device, self.precision):
                    logits = self.forward(x)
                loss = F.cross_entropy(logits.float(), y, reduction="sum",
                                       label_smoothing=self.label_smoothing) / phase.per_worker_batch
                if isinstance(poison, torch.Tensor):
                    loss = loss * poison
                elif poison:
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
        found_inf = self.verdict()
        self.apply(found_inf, step)                                                      # 5
        return loss_sum

    def verdict(self) -> torch.Tensor:
        """Step 4: 1.0 on the device when any all-reduced gradient is non-finite, else 0.0 (float32). A
        non-finite loss on any rank makes the reduced gradients non-finite too; the local loss is not part of
        the verdict, as ranks could disagree on it."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norms = torch._foreach_norm(grads) if grads else [torch.zeros((), device=self.device)]
        return (~torch.isfinite(torch.stack(norms).sum())).float()

    def apply(self, found_inf: torch.Tensor, step: int) -> None:
        """Step 5 on the device: the optimizer step, skipped where `found_inf` is set; the loss scale; the EMA;
        the counters."""
        self.optimizer.found_inf = found_inf   # type: ignore[attr-defined]  # read by LARS, LAMB, fused SGD
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf   # type: ignore[attr-defined]
        if self.scaler.is_enabled():
            self.scaler.update()   # lowers the scale on the inf checks unscale_ recorded (the same gradients)
        ok = (found_inf == 0).to(torch.float64)
        if self.ema is not None:
            update_ema(self.ema, self.model, ok)
        if self.counters is None:
            self.counters = torch.zeros(4, dtype=torch.int64, device=self.device)
            self.counters[DIVERGED_AT].fill_(-1)
            self.counters[STEP].fill_(step)
        c, bad = self.counters, found_inf.to(torch.int64)
        run = (c[RUN] + 1) * bad
        crossed = (run > self.max_nonfinite) & (c[DIVERGED_AT] < 0)
        c.copy_(torch.stack([c[TOTAL] + bad, run, torch.where(crossed, c[STEP], c[DIVERGED_AT]), c[STEP] + 1]))

    def check(self) -> None:
        """Read step 5's counters (a host sync: logging steps, checkpoints, the end): the skipped steps go into
        `progress.nonfinite_total`; a run of more than `max_nonfinite` skipped steps stops training."""
        if self.counters is None:
            return
        total, _, diverged_at, _ = self.counters.tolist()   # the host sync
        self.counters[TOTAL].zero_()
        self.progress.nonfinite_total += total
        if diverged_at >= 0:
            raise Diverged(f"training diverged: {self.max_nonfinite + 1} consecutive steps with non-finite loss or "
                            f"gradients at step {diverged_at}; lower optim.lr, lengthen schedule.warmup_epochs "
                            "or use optim.name=lars.")


def set_lr(optimizer: torch.optim.Optimizer, lr: float, static: bool = False) -> None:
    """Every group's lr: a float, or with `static` a 0-dim tensor on the parameters' device (a CUDA graph's
    static lr) filled in place, a kernel launch and no host sync; float64 where the optimizer reads it so
    (`static_lr_dtype`: LARS, LAMB), else float32 (torch's fused kernels). A tensor lr that a checkpoint brought
    back becomes a float again where `static` is off."""
    dtype = getattr(optimizer, "static_lr_dtype", torch.float32)
    for group in optimizer.param_groups:
        current, device = group["lr"], group["params"][0].device
        if not static:
            group["lr"] = lr
        elif isinstance(current, torch.Tensor) and current.device == device and current.dtype == dtype:
            current.fill_(lr)
        else:
            group["lr"] = torch.full((), lr, dtype=dtype, device=device)


class NoFaults:
    """The fault knob of a step outside `largebatch train` (benches, calibration, scripts): never a fault."""

    def poison(self, step: int) -> bool:
        return False


class LocalBatch(NamedTuple):
    """What `TrainStep` reads of a phase when no schedule made one: the images per worker in a step."""
    per_worker_batch: int
    global_batch: int


def local_step(model: nn.Module, optimizer: torch.optim.Optimizer, *, device: torch.device,
               precision: str = "fp32", channels_last: bool = False, label_smoothing: float = 0.0,
               forward=None, ddp: nn.Module | None = None, world_size: int = 1, ema=None,
               max_nonfinite: int = 2**62) -> "LocalStep":
    """The product's step (steps 2, 4 and 5 above) for a bench, the calibration or a script: `model` and
    `optimizer` built by the caller, `forward` the module the step calls (`ddp`, a compiled model; default:
    `ddp` or `model`), `ddp` the DDP module when `world_size` > 1. No EMA unless given, no noise scale, no
    injected faults, the fp16 loss scale when `precision` is fp16. Call it with the step's micro-batches,
    already on the device, and the lr."""
    ddp = ddp if ddp is not None else model
    step = TrainStep(model=model, ddp=ddp, forward=forward if forward is not None else ddp, optimizer=optimizer,
                     scaler=torch.amp.GradScaler(device.type, enabled=precision == "fp16"), ema=ema, noise=None,
                     faults=NoFaults(), device=device, world_size=world_size, precision=precision,
                     channels_last=channels_last, label_smoothing=label_smoothing, log_every=2**62,
                     max_nonfinite=max_nonfinite, progress=Progress())
    return LocalStep(step, world_size)


class LocalStep:
    """`local_step`'s callable: `step(micros, lr)` runs one optimizer step and returns the summed loss (on the
    device, no host sync); `step.train_step` is the `TrainStep` itself."""

    def __init__(self, train_step: TrainStep, world_size: int) -> None:
        self.train_step, self.world_size, self.count = train_step, world_size, 0

    def __call__(self, micros: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> torch.Tensor:
        per_worker = sum(len(y) for _, y in micros)
        loss = self.train_step(self.count, micros, LocalBatch(per_worker, per_worker * self.world_size), lr)
        self.count += 1
        return loss
