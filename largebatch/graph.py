"""The training step as one CUDA graph (`train.cuda_graph`): forward and backward of every micro-batch, unscale,
the finiteness verdict, the optimizer step, the loss scale's update, the EMA and the skipped-step counters,
captured once per batch shape and replayed each step with no Python and no host sync in between
(torch.cuda.CUDAGraph, as in torch's "whole network capture" recipe and MLPerf's ResNet-50).

1. Where it applies (`plan`): one CUDA process, without the gradient noise scale. It does not apply on CPU,
   across processes (DDP's reducer runs Python between its collectives during the backward; capture across
   processes is not built yet), with `train.noise_scale` (its measuring steps read norms on the host) or
   with a torch.compile mode that captures CUDA graphs of its own (reduce-overhead, max-autotune). With
   torch.compile's default or max-autotune-no-cudagraphs mode the compiled forward and backward are captured
   inside this graph. There `on` is refused with one sentence. `auto` trains eagerly until a GPU check has
   verified the graph (`AUTO_ON_CUDA`, docs/gpu.md), saying so in one line on CUDA with how to turn it on.
2. A step's *shape* is everything a capture bakes in: each micro-batch's shape, dtype and strides (the
   batch key), and the resolution, the per-worker batch (the loss divisor) and every group's weight decay
   (the phase key; the Collapsed Ensemble raises the decay inside a collapse). Each batch key gets its own
   graph, kept while the phase lasts, so a short batch seen before is replayed, not captured again. A new
   batch key first runs `WARMUP` eager steps (lazy state, cuDNN's benchmark choices, torch.compile's
   compilation); then its graph is captured and replayed.
3. Warm-up and capture run on one side stream (`self.side`) and capture uses `capture_error_mode=
   "thread_local"`: the loaders' pin-memory threads may call CUDA while a capture is under way, which the
   default "global" mode turns into an invalidated capture. Replays run on the current stream.
4. Memory: every graph of a phase captures into one pool (`graph_pool_handle`), shared only while those
   graphs are alive. Nothing that outlives a replay lives in the pool: the gradients, optimizer and EMA
   state, lrs, loss scale and counters exist before the first capture (the warm-up made them; the step
   zeroes the gradients in place, never sets them to None), and each graph's loss is copied into a tensor
   allocated outside it. So graphs sharing the pool may be replayed in any order. At a phase change the
   stream is synchronised, every graph is reset explicitly, and the next capture takes a new pool.
5. Capture records and runs nothing, so the capturing step is replayed right after. A replay copies the
   step's batches into the graph's static inputs (device to device), sets the lrs (filled 0-dim tensors,
   largebatch/step.py `set_lr`) and the fault knob's poison scalar, and replays; the loss sum it returns is
   the graph's loss tensor, which the caller adds up before the next replay.
6. A capture that fails stops the run with one sentence naming the first error and `train.cuda_graph=off`:
   a failed capture can leave GradScaler between its unscale and update, and torch's allocator in a state
   that later captures trip over, so training does not go on in that process. The first error is the one
   the capture raised, or the one that error was raised while handling (one hop of `__context__`, unless
   suppressed): a failed capture's `__exit__` raises its own error on top of the body's, and anything deeper
   is what the body's code handled on its way. Running out of memory during capture is a batch too large
   for the device, a user error as in an eager step (the trainer's out-of-memory sentence, memory.py 6):
   that sentence names a smaller `batch.micro_batch`, not the graph.
7. Lifetime: `close()` (called by `Trainer.close`) synchronises and resets every graph then, not at whatever
   time the cyclic garbage collector gets to them. Destroying a graph frees its memory and, with torch's
   per-stream cuBLAS workspaces, can free a workspace another live graph still uses (an illegal address in
   that graph's next replay, reported in PyTorch's tracker), so several trainers in one process (`bench train`, the tests) must not leave
   graphs for the collector. The GraphedStep holds its TrainStep by a weak reference (the TrainStep holds
   it as `graph`): no reference cycle, so graphs are freed by reference counting at the latest.

The CUDA calls go through `cuda` (torch.cuda by default), so tests/fake_cuda.py can stand in for it on CPU.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from largebatch.errors import UserError
from largebatch.optim import zero_grads

WARMUP = 3   # eager steps of each new batch shape before its capture (torch's recipe for one process)

# Whether `train.cuda_graph: auto` uses the graph on one CUDA process. Off until a GPU check has run the graph
# tests and docs/gpu.md records them passing; turning it on is this one line, with that evidence in its commit.
AUTO_ON_CUDA = False

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
    if choice == "auto" and not AUTO_ON_CUDA:
        return False, ("train.cuda_graph auto trains eagerly until a GPU check has verified the graph "
                       "(docs/gpu.md); set train.cuda_graph=on to replay each step as one CUDA graph")
    return True, None


@dataclass
class _Captured:
    """One batch shape's graph, its static inputs and its loss (both allocated outside the graph's pool)."""
    graph: Any
    static_in: list[tuple[torch.Tensor, torch.Tensor]]
    loss: torch.Tensor


class GraphedStep:
    """Steps 2-7 over a `step.TrainStep`: call it as the TrainStep calls its body. `cuda` is torch.cuda, or a
    stand-in with its graph, stream, pool and synchronize calls (tests/fake_cuda.py)."""

    def __init__(self, train_step, *, cuda: Any = None, warmup: int = WARMUP) -> None:
        self.ts = weakref.proxy(train_step)         # not a cycle with train_step.graph (step 7)
        self.cuda = cuda if cuda is not None else torch.cuda
        self.device = train_step.device
        self.warmup = warmup
        self.side = self.cuda.Stream(self.device)   # warm-up and capture (step 3)
        self.pool: Any = None                       # the pool of the current phase's graphs (step 4)
        self.phase_key: tuple | None = None
        self.graphs: dict[tuple, _Captured] = {}    # batch key -> its graph, for the current phase
        self.seen: dict[tuple, int] = {}            # eager steps run per batch key in the current phase
        self.poison = torch.ones((), device=self.device)
        self.captures = 0                           # graphs captured (tests, the log)
        self.released = 0                           # graphs reset at phase changes and at close

    def shape(self, micros, phase, size) -> tuple[tuple, tuple]:
        """Step 2: (batch key, phase key): what a capture bakes in."""
        batches = tuple((tuple(x.shape), x.dtype, x.stride(), tuple(y.shape), y.dtype) for x, y in micros)
        decays = tuple(g["weight_decay"] for g in self.ts.optimizer.param_groups)
        return batches, (size, phase.per_worker_batch, decays)

    def __call__(self, step: int, micros, phase, size) -> torch.Tensor:
        micros = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)) for x, y in micros]
        poisoned = self.ts.faults.poison(step)
        batch_key, phase_key = self.shape(micros, phase, size)
        if phase_key != self.phase_key:
            self.release()
            self.phase_key = phase_key
        captured = self.graphs.get(batch_key)
        if captured is None:
            if self.seen.get(batch_key, 0) < self.warmup:
                self.seen[batch_key] = self.seen.get(batch_key, 0) + 1
                return self._eager(step, micros, phase, size, poisoned)
            captured = self._capture(step, micros, phase, size)
            self.graphs[batch_key] = captured
        return self._replay(captured, micros, poisoned)

    def release(self) -> None:
        """Step 4 at a phase change: wait for the last replay, reset every graph, forget the pool."""
        if self.graphs:
            self.cuda.synchronize(self.device)
            for captured in self.graphs.values():
                captured.graph.reset()
                self.released += 1
        self.graphs, self.seen, self.pool = {}, {}, None

    def close(self) -> None:
        """Step 7: every graph synchronised, reset and dropped with its static inputs and pool, now. Idempotent;
        a later call captures afresh."""
        self.release()
        self.phase_key = None

    def _zero_grads(self) -> None:
        """Gradients zeroed in place: their memory stays where the graphs read and write it (step 4)."""
        zero_grads(self.ts.optimizer)

    def _eager(self, step, micros, phase, size, poisoned) -> torch.Tensor:
        """A warm-up step, on the side stream as torch's recipe has it."""
        current = self.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with self.cuda.stream(self.side):
            for x, y in micros:
                if x.is_cuda:   # made on the current stream, read on the side stream
                    x.record_stream(self.side)
                    y.record_stream(self.side)
            self._zero_grads()
            loss = self.ts.body(step, micros, phase, size, poisoned)
        current.wait_stream(self.side)
        if loss.is_cuda:
            loss.record_stream(current)
        return loss

    def _capture(self, step, micros, phase, size) -> _Captured:
        """Step 5's capture, on the warm-up's stream into the phase's pool; step 6 when it fails."""
        static_in = [(x.clone(), y.clone()) for x, y in micros]   # valid labels even where capture runs ops
        loss_out = torch.zeros((), device=self.device)
        if self.pool is None:
            self.pool = self.cuda.graph_pool_handle()
        self.cuda.synchronize(self.device)
        graph = self.cuda.CUDAGraph()
        try:
            with self.cuda.graph(graph, pool=self.pool, stream=self.side, capture_error_mode="thread_local"):
                self._zero_grads()
                loss_out.copy_(self.ts.body(step, static_in, phase, size, self.poison))
        except Exception as err:   # noqa: BLE001 - any failure is reported the same way
            first: BaseException = err   # the capture's own error, under what __exit__ raised after it (step 6)
            if err.__context__ is not None and not err.__suppress_context__:
                first = err.__context__
            what = (str(first).strip().splitlines() or [""])[0][:300]
            if any(_out_of_memory(e) for e in (first, err)):
                current = max(len(y) for _, y in micros)
                what = what.split(". ")[0]   # torch's "CUDA out of memory. Tried to allocate ...": its first clause
                raise UserError(f"the device ran out of memory capturing the training step as a CUDA graph at step "
                                f"{step} with forward batches of {current} images ({what}); set batch.micro_batch "
                                f"below {current} (e.g. {max(current // 2, 1)}).") from err
            raise UserError(f"capturing the training step as a CUDA graph failed at step {step} "
                            f"({type(first).__name__}: {what}); set train.cuda_graph=off to train without it.") from err
        self.captures += 1
        return _Captured(graph, static_in, loss_out)

    def _replay(self, captured: _Captured, micros, poisoned: bool) -> torch.Tensor:
        """Step 5's replay."""
        for (sx, sy), (x, y) in zip(captured.static_in, micros):
            sx.copy_(x, non_blocking=True)
            sy.copy_(y, non_blocking=True)
        self.poison.fill_(float("nan") if poisoned else 1.0)
        captured.graph.replay()
        return captured.loss


def _out_of_memory(err: BaseException) -> bool:
    """torch's OutOfMemoryError (the caching allocator), or a RuntimeError whose message says so (CUDA's own
    "out of memory" error, raised by a call that does not go through the allocator)."""
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and "out of memory" in str(err))
