"""A node of N fake GPUs for one torchrun worker, on the CPU: the multi-GPU contract test's stand-in for CUDA and
NCCL (tests/integration/test_multi_gpu_contract.py). Run as torchrun's script, it installs the fake and then runs
`python -m largebatch ARGS` in the same interpreter:

    torchrun --nproc-per-node 2 tests/fake_gpus.py train RECIPE ...   (LB_FAKE_GPUS=2, LB_FAKE_GPU_LOG=DIR)

What it follows, from torch's and CUDA's documentation:
- The current device is per host thread and starts at 0 in every thread (cudaSetDevice: "for the calling host
  thread"; torch.cuda.set_device is that call). `torch.cuda.device(d)` and `torch.cuda.stream(s)` make d (the
  stream's device) current for their block. An index outside 0..N-1 raises "invalid device ordinal".
- A device given without an index (`"cuda"`, `torch.device("cuda")`) means the calling thread's current device,
  for tensor factories, `.to`, streams and events (the caching allocator allocates on the current device).
- Pinned host memory (`pin_memory()`, `pin_memory=True`) is allocated through the current device's context.
- `init_process_group(backend="nccl", device_id=d)` binds the group to d but does not make d current (the
  `device_id` documentation names two effects: eager init and comm split).
- NCCL's object collectives (`all_gather_object`, `broadcast_object_list`, `gather_object`, ...) marshal their
  objects on `torch.cuda.current_device()`; a barrier without `device_ids` on a group not bound to a device
  uses it too. So every collective is recorded with the calling thread's current device.
- torch's DataLoader pins in a thread that it first sets to the device that was current where the iterator was
  made (`torch.accelerator.current_device_index()`; torch/utils/data/_utils/pin_memory.py).
- DistributedDataParallel's `device_ids=[d]` names the replica's device.

Every device the worker names (a factory's or `.to`'s device, `.cuda()`, a stream, an event's stream,
`record_stream`, pinned memory, `get_device_properties`, `mem_get_info`, `synchronize`, DDP's `device_ids`, the
group's `device_id`, the current device at every collective) is appended, once per (what, device, thread, call site), to
LB_FAKE_GPU_LOG/rank<RANK>.jsonl with where in largebatch it was named; so is each `set_device` and the process
group's creation, in order. The file is written as the run goes: a worker that ends with os._exit loses nothing.

What it cannot show: tensors stay on the CPU (a device named is recorded, then replaced by the CPU), so a branch on
a tensor's own device (`x.is_cuda`, `x.device`) takes the CPU path and a tensor made on the device of another
tensor is not followed; the group is gloo, so NCCL's own checks (two ranks on one GPU, a collective whose
tensors sit on another device than the group's) are not run; kernels, streams and memory are not modelled.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

GIB = 1 << 30


class FakeNode:
    """N GPUs of `total` bytes each, `free` of them free; the per-thread current device; the log of devices named."""

    def __init__(self, n: int, log: Path | None, total: int = 80 * GIB, free: int = 79 * GIB) -> None:
        self.n, self.total, self.free = n, total, free
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._seen: set[tuple[str, int, str, str]] = set()
        self.log = log
        self.records: list[dict] = []

    # -- the current device, per thread
    def current(self) -> int:
        return getattr(self._tls, "device", 0)

    def index(self, device: Any) -> int:
        """The index that `device` names: an int, 'cuda', 'cuda:k', torch.device; None or no index: the current."""
        if device is None:
            return self.current()
        if isinstance(device, int):
            idx = device
        else:
            d = torch.device(device)
            if d.type != "cuda":
                raise ValueError(f"not a CUDA device: {device!r}")
            idx = self.current() if d.index is None else d.index
        if not 0 <= idx < self.n:
            raise RuntimeError(f"CUDA error: invalid device ordinal (device {idx} of {self.n})")
        return idx

    def set_current(self, device: Any) -> None:
        idx = self.index(device)
        self._tls.device = idx
        self.event("set_device", idx)

    # -- the log
    def _write(self, rec: dict) -> None:
        with self._lock:
            self.records.append(rec)
            if self.log is not None:
                with open(self.log, "a") as f:
                    f.write(json.dumps(rec) + "\n")

    def touch(self, what: str, device: Any = None) -> int:
        idx = self.index(device)
        key = (what, idx, threading.current_thread().name, _where())
        if key not in self._seen:
            self._seen.add(key)
            self._write({"kind": "touch", "what": what, "device": idx, "thread": key[2], "where": key[3]})
        return idx

    def event(self, what: str, device: int, **extra: Any) -> None:
        self._write({"kind": "event", "what": what, "device": device, "thread": threading.current_thread().name,
                     "where": _where(), **extra})


def _where() -> str:
    """The innermost frames in largebatch (or the first outside this file), for the log."""
    frames = [f for f in traceback.extract_stack()[:-3] if "fake_gpus.py" not in f.filename]
    ours = [f for f in frames if "/largebatch/" in f.filename]
    pick = ours[-3:] if ours else frames[-2:]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(pick))


def _is_cuda(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and (value == "cuda" or value.startswith("cuda:"))


class DeviceRecorder(TorchFunctionMode):
    """Records every CUDA device a torch function is given, then runs it on the CPU."""

    def __init__(self, node: FakeNode) -> None:
        super().__init__()
        self.node = node

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", str(func))
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            device = args[1] if len(args) > 1 else kwargs.get("device")
            self.node.touch("Tensor.cuda", device)
            return args[0].clone()
        if name == "pin_memory" and args and isinstance(args[0], torch.Tensor):
            self.node.touch("pin_memory")
            return args[0]
        if kwargs.get("pin_memory"):
            self.node.touch(f"{name}(pin_memory=True)")
            kwargs["pin_memory"] = False
        if _is_cuda(kwargs.get("device")):
            self.node.touch(name, kwargs["device"])
            kwargs["device"] = "cpu"
        if name == "to":
            args = tuple(self._to_cpu(name, a) for a in args)
        return func(*args, **kwargs)

    def _to_cpu(self, name: str, value: Any) -> Any:
        if _is_cuda(value):
            self.node.touch(name, value)
            return "cpu"
        return value


class FakeStream:
    def __init__(self, node: FakeNode, device: Any = None) -> None:
        self.node = node
        self.device_index = node.touch("Stream", device)
        self.device = torch.device("cuda", self.device_index)

    def wait_stream(self, other: FakeStream) -> None:
        self.node.touch("Stream.wait_stream", self.device_index)

    def wait_event(self, event: FakeEvent) -> None:
        self.node.touch("Stream.wait_event", self.device_index)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent(self.node)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.node.touch("Stream.synchronize", self.device_index)

    def query(self) -> bool:
        return True

    @property
    def cuda_stream(self) -> int:
        return 0


class FakeEvent:
    def __init__(self, node: FakeNode, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.node = node

    def record(self, stream: FakeStream | None = None) -> None:
        self.node.touch("Event.record", stream.device_index if stream is not None else None)

    def wait(self, stream: FakeStream | None = None) -> None:
        self.node.touch("Event.wait", stream.device_index if stream is not None else None)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: FakeEvent) -> float:
        return 0.0


OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")
TENSOR_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                      "reduce", "barrier", "monitored_barrier", "all_to_all_single", "send", "recv", "isend",
                      "irecv", "batch_isend_irecv")


def install(n: int, log: Path | None = None) -> FakeNode:
    """Make this process believe it holds `n` GPUs (the module docstring); return the node that records."""
    node = FakeNode(n, log)
    cuda, acc = torch.cuda, torch.accelerator
    streams: dict[int, FakeStream] = {}

    def current_stream(device: Any = None) -> FakeStream:
        stack = getattr(node._tls, "streams", None)
        idx = node.index(device)
        if stack and stack[-1].device_index == idx:
            return stack[-1]
        if idx not in streams:
            streams[idx] = FakeStream(node, idx)
        return streams[idx]

    @contextlib.contextmanager
    def stream_ctx(stream: FakeStream | None):
        if stream is None:
            yield
            return
        before = node.current()
        node._tls.device = stream.device_index   # the stream's device is current inside the block
        node._tls.streams = [*getattr(node._tls, "streams", []), stream]
        try:
            yield
        finally:
            node._tls.streams.pop()
            node._tls.device = before

    class device_ctx:   # noqa: N801 - torch's name
        def __init__(self, device: Any) -> None:
            self.idx = node.index(device) if device is not None and device != -1 else None

        def __enter__(self):
            self.before = node.current()
            if self.idx is not None:
                node._tls.device = self.idx

        def __exit__(self, *exc):
            node._tls.device = self.before

    def props(device: Any = None) -> SimpleNamespace:
        node.touch("get_device_properties", device)
        return SimpleNamespace(name="Fake GPU", total_memory=node.total, major=9, minor=0,
                               multi_processor_count=132, L2_cache_size=50 << 20)

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        node.touch("mem_get_info", device)
        return node.free, node.total

    def touching(what: str, value: Any = None):
        def call(device: Any = None, *args: Any, **kwargs: Any) -> Any:
            node.touch(what, device if isinstance(device, (int, str, torch.device)) else None)
            return value
        return call

    replace = {
        "is_available": lambda: True, "device_count": lambda: n, "current_device": node.current,
        "set_device": node.set_current, "device": device_ctx, "get_device_properties": props,
        "get_device_name": lambda device=None: props(device).name,
        "get_device_capability": lambda device=None: (props(device).major, props(device).minor),
        "mem_get_info": mem_get_info, "synchronize": touching("synchronize"), "empty_cache": touching("empty_cache"),
        "is_bf16_supported": lambda *a, **k: True, "is_initialized": lambda: True,
        "memory_allocated": touching("memory_allocated", 0), "max_memory_allocated": touching("memory_allocated", 0),
        "memory_reserved": touching("memory_reserved", 0), "max_memory_reserved": touching("memory_reserved", 0),
        "reset_peak_memory_stats": touching("reset_peak_memory_stats"),
        "Stream": lambda device=None, priority=0: FakeStream(node, device), "current_stream": current_stream,
        "default_stream": current_stream, "stream": stream_ctx,
        "Event": lambda *a, **k: FakeEvent(node, *a, **k),
        "manual_seed": lambda seed: None, "manual_seed_all": lambda seed: None, "seed_all": lambda: None,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "get_rng_state_all": lambda: [torch.get_rng_state() for _ in range(n)],
        "set_rng_state": lambda state, device="cuda": None, "set_rng_state_all": lambda states: None,
    }
    for name, value in replace.items():
        setattr(cuda, name, value)
    acc.is_available = lambda: True
    acc.device_count = lambda: n
    acc.current_accelerator = lambda check_available=False: torch.device("cuda")
    acc.current_device_index = node.current
    acc.set_device_index = node.set_current
    acc.synchronize = touching("accelerator.synchronize")

    # the process group: NCCL bound to device_id, recorded; run as gloo on the CPU
    real_init = dist.init_process_group

    @functools.wraps(real_init)
    def init_process_group(*args: Any, **kwargs: Any):
        device_id = kwargs.pop("device_id", None)
        bound = node.index(device_id) if device_id is not None else None
        node.event("init_process_group", node.current(), bound=bound, backend=str(kwargs.get("backend")))
        if bound is not None:
            node.touch("init_process_group(device_id)", bound)
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        return real_init(*args, **kwargs)

    dist.init_process_group = init_process_group
    real_new_group = dist.new_group

    @functools.wraps(real_new_group)
    def new_group(*args: Any, **kwargs: Any):
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        kwargs.pop("device_id", None)
        return real_new_group(*args, **kwargs)

    dist.new_group = new_group
    for name in (*OBJECT_COLLECTIVES, *TENSOR_COLLECTIVES):
        real = getattr(dist, name, None)
        if real is None:
            continue

        def wrapped(*args: Any, _real=real, _name=name, **kwargs: Any):
            node.touch(f"collective {_name} (current device)")
            return _real(*args, **kwargs)

        setattr(dist, name, functools.wraps(real)(wrapped))

    def record_stream(self: torch.Tensor, stream: FakeStream) -> None:   # torch parses a real Stream first
        node.touch("record_stream", stream.device_index)

    torch.Tensor.record_stream = record_stream   # type: ignore[method-assign,assignment]

    ddp = torch.nn.parallel.DistributedDataParallel
    real_ddp_init = ddp.__init__

    @functools.wraps(real_ddp_init)
    def ddp_init(self, module, device_ids=None, output_device=None, *args: Any, **kwargs: Any):
        for d in device_ids or ():
            node.touch("DistributedDataParallel(device_ids)", d)
        if output_device is not None:
            node.touch("DistributedDataParallel(output_device)", output_device)
        real_ddp_init(self, module, None, None, *args, **kwargs)

    ddp.__init__ = ddp_init

    # every thread records, as the main thread does (torch function modes are per thread)
    recorder = DeviceRecorder(node)
    real_bootstrap = threading.Thread._bootstrap_inner   # type: ignore[attr-defined]

    def bootstrap_inner(self) -> None:
        with DeviceRecorder(node):
            real_bootstrap(self)

    threading.Thread._bootstrap_inner = bootstrap_inner   # type: ignore[attr-defined]
    recorder.__enter__()
    return node


def main() -> None:
    n = int(os.environ.get("LB_FAKE_GPUS", "2"))
    log_dir = os.environ.get("LB_FAKE_GPU_LOG")
    log = Path(log_dir) / f"rank{os.environ.get('RANK', '0')}.jsonl" if log_dir else None
    install(n, log)
    import runpy

    sys.argv = ["largebatch", *sys.argv[1:]]
    runpy.run_module("largebatch", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
