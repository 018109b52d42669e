"""A stand-in for the torch.cuda calls that largebatch/graph.py makes, on CPU tensors, following torch's documented
behaviour of CUDA graphs (torch.cuda.CUDAGraph, torch.cuda.graph, "CUDA Graphs" in torch's CUDA semantics notes):

- `graph(g, pool=, stream=, capture_error_mode=)` captures: every ATen op the block dispatches is recorded (a
  TorchDispatchMode) with the very tensor objects it read and wrote. Capture "records and runs nothing": the ops
  do run (they must, to give later ops their inputs), but every tensor they wrote is put back as it was when the
  capture ends, so the capturing step changes no state, as on a GPU.
- `CUDAGraph.replay()` re-runs the recorded ops on the same tensor objects and copies each op's new result into
  the tensor the capture gave out: the addresses are static, a replay reads whatever those tensors hold now, and
  any Python value the capture saw (a float lr, a weight decay, a loss divisor) is baked in.
- Reading a tensor's value on the host during capture raises, as "operation not permitted when stream is
  capturing" does on a GPU; so does a capture into a pool whose graphs were all reset (torch's allocator then
  asserts on the pool's use count, or later faults).
- Every call is logged (`calls`): the capture mode, stream and pool of each capture, synchronize, reset.

What it cannot show: kernels, streams and memory themselves. Ops run in order on one CPU thread, so a missing
stream wait, a race with another thread's CUDA call under the "global" capture mode, an allocator that reuses a
block too early, or cuDNN choosing another algorithm at capture are not seen here; tests/integration/test_cuda.py runs the
real graph on a GPU.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default}
# Ops that write arguments their schema does not mark as written: native_batch_norm updates running_mean and
# running_var (arguments 3 and 4) in place in training mode.
UNMARKED_WRITES = {torch.ops.aten.native_batch_norm.default: (3, 4)}


class FakeStream:
    _ids = itertools.count(1)

    def __init__(self, device=None) -> None:
        self.id = next(self._ids)
        self.waited_on: list[FakeStream] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited_on.append(other)

    def __repr__(self) -> str:
        return f"FakeStream({self.id})"


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class _Recorder(TorchDispatchMode):
    """Records ops; keeps the bytes of every tensor an op writes, from before its first write in the capture."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _save(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self.saved and storage.nbytes() > 0:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            self.saved[key] = (whole, whole.clone())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({func} reads a "
                               "tensor on the host)")
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in _tensors(value):
                    self._save(t)
        for i in UNMARKED_WRITES.get(func, ()):
            for t in _tensors(args[i] if i < len(args) else None):
                self._save(t)
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def restore(self) -> None:
        for whole, before in self.saved.values():
            whole.copy_(before)
        self.saved.clear()


class FakeGraph:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.ops: list[tuple[Any, tuple, dict, Any]] | None = None
        self.pool: Any = None
        self.replays = 0

    def replay(self) -> None:
        if self.ops is None:
            raise RuntimeError("replay of a graph that was never captured, or was reset")
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                new = func(*args, **kwargs)
                for old, fresh in zip(_tensors(out), _tensors(new)):
                    if old is fresh or old.untyped_storage().data_ptr() == fresh.untyped_storage().data_ptr():
                        continue   # written in place, or a view of what the op read: already where it belongs
                    old.copy_(fresh)
        self.replays += 1

    def reset(self) -> None:
        self.cuda.calls.append(("reset", self.pool))
        if self.ops is not None:
            self.cuda.pool_users[self.pool] -= 1
        self.ops = None


class FakeCuda:
    """The torch.cuda calls of largebatch/graph.py (see the module docstring)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._current = FakeStream()
        self._stack: list[FakeStream] = []
        self._pools = itertools.count(1)
        self.pool_users: dict[Any, int] = {}
        self.pools_given: list[Any] = []

    def Stream(self, device=None) -> FakeStream:   # noqa: N802 - torch's name
        return FakeStream(device)

    def current_stream(self, device=None) -> FakeStream:
        return self._stack[-1] if self._stack else self._current

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    def synchronize(self, device=None) -> None:
        self.calls.append(("synchronize",))

    def graph_pool_handle(self) -> tuple:
        pool = ("pool", next(self._pools))
        self.pool_users[pool] = 0
        self.pools_given.append(pool)
        return pool

    def CUDAGraph(self) -> FakeGraph:   # noqa: N802 - torch's name
        return FakeGraph(self)

    @contextlib.contextmanager
    def graph(self, cuda_graph: FakeGraph, pool=None, stream=None, capture_error_mode: str = "global"):
        self.calls.append(("capture", pool, stream, capture_error_mode))
        if pool is not None and pool in self.pool_users and self.pool_users[pool] == 0 and \
                any(c[0] == "reset" and c[1] == pool for c in self.calls):
            raise RuntimeError("captured into a pool whose graphs were all reset (use_count assert)")
        recorder = _Recorder()
        self._stack.append(stream if stream is not None else FakeStream())
        try:
            with recorder:
                yield
        finally:
            self._stack.pop()
            recorder.restore()   # capture runs nothing: the state is as it was before it
        cuda_graph.ops, cuda_graph.pool = recorder.ops, pool
        if pool is not None:
            self.pool_users[pool] = self.pool_users.get(pool, 0) + 1
