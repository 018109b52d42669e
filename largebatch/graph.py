"""The training step as one CUDA graph (`train.cuda_graph`): forward and backward of every micro-batch, unscale,
the finiteness verdict, the optimizer step, the loss scale's update, the EMA and the skipped-step counters,
captured once and replayed each step with no Python and no host sync in between (torch.cuda.CUDAGraph, as in
torch's "whole network capture" recipe and MLPerf's ResNet-50).

1. Where it applies (`plan`): one CUDA process, without the gradient noise scale. It does not apply on CPU,
   across processes (DDP's reducer runs Python between its collectives during the backward; capture across
   processes is not built yet), with `train.noise_scale` (its measuring steps read norms on the host) or
   with a torch.compile mode that captures CUDA graphs of its own (reduce-overhead, max-autotune). With
   torch.compile's default or max-autotune-no-cudagraphs mode the compiled forward and backward (Triton
   and library kernels) are captured inside this graph.
   There `auto` trains eagerly, saying so in one line when on CUDA, and `on` is refused with one sentence.
2. A step's *shape* is everything the capture bakes in: each micro-batch's shape, dtype and strides, the
   resolution, the per-worker batch (the loss divisor) and every group's weight decay (the Collapsed
   Ensemble raises it inside a collapse). A new shape (a batch phase, a resolution phase, a collapse) first
   runs `WARMUP` eager steps on a side stream (lazy state, cuDNN's choices, torch.compile's compilation),
   then its graph is captured and replayed; the previous graph is released.
3. Capture records and runs nothing, so the capturing step is replayed right after. A replay copies the
   step's batches into the graph's static inputs (device to device), sets the lrs (filled 0-dim tensors,
   largebatch/step.py `set_lr`) and the fault knob's poison scalar, and replays; the loss sum it returns is
   the graph's static output, read by the caller before the next replay.
4. The gradients live in the graph's memory pool: they are set to None before capture, so that the captured
   backward allocates them there, and never set to None again while the graph is in use.
"""
from __future__ import annotations

import sys

import torch

from largebatch.errors import UserError

WARMUP = 3   # eager steps of each new shape before its capture (torch's recipe for one process)


GRAPHING_COMPILE_MODES = ("reduce-overhead", "max-autotune")   # torch.compile modes with CUDA graphs of their own


def plan(choice: str, device: torch.device, world_size: int, noise_scale: bool, compile_mode: str | None = None
         ) -> tuple[bool, str | None]:
    """Step 1: (use a graph, the reason it does not apply or None). Raises UserError when `on` cannot apply.
    `compile_mode` is torch.compile's mode when the model is compiled, else None."""
    reason = None
    if device.type != "cuda":
        reason = "CUDA graphs need a CUDA device"
    elif world_size > 1:
        reason = "capture across processes (DDP) is not supported yet"
    elif noise_scale:
        reason = "train.noise_scale reads gradient norms on the host on its measuring steps"
    elif compile_mode in GRAPHING_COMPILE_MODES:
        reason = f"torch.compile's mode {compile_mode} captures CUDA graphs of its own"
    if choice == "off":
        return False, None
    if reason is not None:
        if choice == "on":
            raise UserError(f"train.cuda_graph is on but {reason}; set train.cuda_graph to auto or off.")
        return False, reason if device.type == "cuda" else None
    return True, None


class GraphedStep:
    """Steps 2-4 over a `step.TrainStep`: call it as the TrainStep calls its body."""

    def __init__(self, train_step, *, strict: bool) -> None:
        self.ts, self.strict = train_step, strict
        self.device = train_step.device
        self.pool = torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream(self.device)
        self.key: tuple | None = None
        self.seen = 0                       # eager steps run at the current key
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_in: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.static_loss: torch.Tensor | None = None
        self.poison = torch.ones((), device=self.device)
        self.captures = 0                   # how many graphs were captured (tests, the log)

    def shape(self, micros, phase, size) -> tuple:
        """Step 2: what a capture bakes in."""
        batches = tuple((tuple(x.shape), x.dtype, x.stride(), tuple(y.shape), y.dtype) for x, y in micros)
        decays = tuple(g["weight_decay"] for g in self.ts.optimizer.param_groups)
        return batches, size, phase.per_worker_batch, decays

    def __call__(self, step: int, micros, phase, size) -> torch.Tensor:
        micros = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)) for x, y in micros]
        poisoned = self.ts.faults.poison(step)
        key = self.shape(micros, phase, size)
        if key != self.key:
            self.key, self.seen, self.graph, self.static_in, self.static_loss = key, 0, None, [], None
        if self.graph is None and self.seen < WARMUP:
            self.seen += 1
            return self._eager(step, micros, phase, size, poisoned)
        if self.graph is None:
            try:
                self._capture(step, micros, phase, size)
            except Exception as e:   # an op that cannot be captured: say so once, and train eagerly
                if self.strict:
                    raise
                print(f"largebatch: CUDA graph capture failed ({type(e).__name__}: {e}); training continues "
                      "without it (train.cuda_graph=off hides this line).", file=sys.stderr, flush=True)
                self.ts.graph = None
                self.ts.optimizer.zero_grad(set_to_none=True)
                return self.ts.body(step, micros, phase, size, poisoned)
        return self._replay(micros, poisoned)

    def _eager(self, step, micros, phase, size, poisoned) -> torch.Tensor:
        """A warm-up step, on a side stream as torch's recipe has it."""
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            for x, y in micros:
                x.record_stream(self.side)
                y.record_stream(self.side)
            self.ts.optimizer.zero_grad(set_to_none=True)
            loss = self.ts.body(step, micros, phase, size, poisoned)
        current.wait_stream(self.side)
        loss.record_stream(current)
        return loss

    def _capture(self, step, micros, phase, size) -> None:
        """Step 3's capture; step 4's gradients."""
        self.static_in = [(torch.empty_like(x), torch.empty_like(y)) for x, y in micros]
        self.ts.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.static_loss = self.ts.body(step, self.static_in, phase, size, self.poison)
        self.graph = graph
        self.captures += 1

    def _replay(self, micros, poisoned: bool) -> torch.Tensor:
        """Step 3's replay."""
        assert self.graph is not None and self.static_loss is not None
        for (sx, sy), (x, y) in zip(self.static_in, micros):
            sx.copy_(x, non_blocking=True)
            sy.copy_(y, non_blocking=True)
        self.poison.fill_(float("nan") if poisoned else 1.0)
        self.graph.replay()
        return self.static_loss
