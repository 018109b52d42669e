"""The one launch path: the torchrun environment.

`init()` reads RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK as
torchrun sets them; without them it is a single process (world size 1) and the
same code runs. gloo on CPU, NCCL on CUDA.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from largebatch.errors import UserError, env_int


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


TORCHRUN_FIX = "torchrun sets it for its workers; unset it to run one process, or launch with torchrun"


def env_info() -> DistInfo:
    """Layout from the torchrun environment, without initialising anything. A value that is not a whole
    number, or a rank outside its world, is one sentence naming the variable."""
    world = env_int("WORLD_SIZE", 1, low=1, fix=TORCHRUN_FIX)
    local_world = env_int("LOCAL_WORLD_SIZE", world, low=1, high=world, fix=TORCHRUN_FIX)
    rank = env_int("RANK", 0, high=world - 1, fix=f"it must be below WORLD_SIZE ({world}); {TORCHRUN_FIX}")
    local_rank = env_int("LOCAL_RANK", 0, high=local_world - 1,
                         fix=f"it must be below LOCAL_WORLD_SIZE ({local_world}); {TORCHRUN_FIX}")
    node = "GROUP_RANK" if "GROUP_RANK" in os.environ else "NODE_RANK"
    node_rank = env_int(node, 0, fix=TORCHRUN_FIX)
    if world > 1:
        check_master()
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                    node_rank=node_rank)


def check_master() -> None:
    """A multi-process run's MASTER_ADDR names a host this machine can resolve and MASTER_PORT is a port; else
    one sentence naming the variable (torch would raise from deep inside its rendezvous)."""
    port = env_int("MASTER_PORT", 29500, low=1, high=65535, fix=TORCHRUN_FIX)
    addr = os.environ.get("MASTER_ADDR")
    if addr is None:
        return   # torchrun's agent store or torch's own default
    try:
        socket.getaddrinfo(addr, port)
    except (socket.gaierror, UnicodeError, ValueError):
        raise UserError(f"the environment variable MASTER_ADDR is {addr!r}, which is no host name or address this "
                        f"machine can resolve; give the rank-0 host's name or IP address ({TORCHRUN_FIX}).") from None


# torchrun's variables that a worker reads, and the one it sets that nothing else does (the rendezvous run id,
# "TORCHELASTIC_RUN_ID ... equal to the rendezvous run_id" in torchrun's documentation of its environment)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN_MARK = "TORCHELASTIC_RUN_ID"


def check_launcher_env(fix: str) -> None:
    """torchrun's variables in a process that torchrun did not start (no TORCHELASTIC_RUN_ID): values left in the
    shell from an earlier job script, with which the process would wait for peers that never come (for
    comm.timeout_s, then a traceback). One sentence naming them, at once; `fix` says how to start this command."""
    if TORCHRUN_MARK in os.environ:
        return
    present = [f"{k}={os.environ[k]}" for k in LAUNCH_VARS if k in os.environ]
    if present:
        names = " ".join(k for k in LAUNCH_VARS if k in os.environ)
        raise UserError(f"the environment holds {', '.join(present)} but no torchrun started this process (it sets "
                        f"{TORCHRUN_MARK} for its workers), so they are left from an earlier job; run "
                        f"'unset {names}' and start again ({fix}).")


def restart_count() -> int:
    """Which elastic restart attempt this process belongs to (0 for the first)."""
    return env_int("TORCHELASTIC_RESTART_COUNT", 0, fix=TORCHRUN_FIX)


def namespace() -> str:
    """largebatch's key space in the launcher's store for this run (torchrun's run id)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"largebatch/{run_id}"


def attempt_store(timeout_s: float):
    """The process group's store for this restart attempt, or None to let torch build it.

    torchrun's c10d rendezvous hands every attempt the same agent TCPStore, so after a restart a
    worker can read the gloo/NCCL addresses that the killed attempt published and fail with
    "connection refused". A PrefixStore per attempt gives each attempt fresh keys.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(f"{namespace()}/attempt{restart_count()}/pg", store)


def init(device: torch.device, timeout_s: float = 600.0) -> DistInfo:
    """Initialise the default process group when launched by torchrun."""
    info = env_info()
    if info.world_size > 1:
        check_launcher_env("one process as it is, or N workers with --nproc-per-node N or torchrun")
    if info.world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {}
        if device.type == "cuda":
            kwargs["device_id"] = device
        store = attempt_store(timeout_s)   # per-restart key space (stale keys of a killed attempt otherwise)
        if store is not None:
            kwargs.update(store=store, rank=info.rank, world_size=info.world_size)
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        global _had_group
        _had_group = True
    return info


def shutdown(barrier: bool = False, timeout_s: float = 60.0) -> None:
    """Steps 2 and 3 of the ordered teardown (step 1, stopping and joining every thread of ours that
    touches the store or a group, is `Trainer.close`): after a successful run a barrier with a timeout on
    every rank together, then destroy the process groups, on every exit path.

    Without the barrier a rank that finished first closes its connections while rank 0 is still
    writing the summary and plots. On an error path no barrier: the other ranks may be gone.
    The barrier is gloo's monitored barrier where it can be (it names the rank that did not arrive).

    Every group is kept referenced (`_kept_groups`) until the process ends with os._exit (`end_process`, or a
    warm worker's exit after its return, `launch.worker`), so that no group's C++ destructor ever runs. Why:
    once a group is destroyed, the last reference to it can be DDP's reducer, which Python frees with the GIL
    held (pybind11's dealloc, when `train`'s frame returns); ProcessGroupGloo's destructor then joins its worker
    threads (pt_gloo_runloop), and one still releasing its last work (an all-gather's tensors) waits for that
    GIL: each waits for the other, for ever. Seen with py-spy on a hung rank of a 2-worker launch (its peer
    had ended): the main thread in ~ProcessGroupGloo's std::thread::join under the reducer's dealloc, a gloo
    thread in gil_scoped_acquire under ~AsyncAllgatherWork (docs/reliability.md, Teardown).
    """
    if not dist.is_initialized():
        return
    _kept_groups.extend(_all_groups())
    try:
        if barrier:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
            else:
                dist.barrier()
    finally:
        dist.destroy_process_group()


def _all_groups() -> list:
    """The default group and every group made from it (torch's registry of them; the default group alone where a
    release has no such registry)."""
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    groups = list(registry) if isinstance(registry, dict) else []
    world = dist.group.WORLD
    return groups if world in groups or world is None else [world, *groups]


_stuck_threads: list[str] = []
_kept_groups: list = []   # every group `shutdown` destroyed, never freed before the process ends (see there)
_had_group = False   # this process created a process group (set by `init`)
returns_to_agent = False   # a worker forked by the launcher's forkserver (launch.worker): code 0 returns to the agent


def note_stuck_thread(name: str) -> None:
    """Record a thread of ours that did not end when joined (e.g. inside a collective with a dead peer)."""
    _stuck_threads.append(name)


def end_process(code: int, ran_group: bool = False) -> None:
    """The last step of the teardown, for a process that ran a process group or still has a thread of ours
    that could not be joined: flush what was printed and exit with `code` without interpreter finalization.

    Why: a native thread that re-enters Python while the interpreter finalizes is ended by CPython with
    pthread_exit, and its unwinding through a noexcept C++ frame (pybind11's GIL guards) calls
    std::terminate: "terminate called without an active exception", exit code -6, after a run that
    succeeded. Our own threads are joined before this (`Trainer.close`), but gloo's worker threads
    (pt_gloo_runloop) outlive `destroy_process_group` once DDP has used the group (DDP keeps a reference
    to it from C++), and one that is slow to drop its last work under CPU load can release a Python-owned
    tensor, which takes the GIL, during finalization. Everything the run writes is closed and fsync'ed
    before this point; nothing is left for finalization to do. Returns (normal exit) otherwise.
    `ran_group`: the caller ran a process group of its own (a training loop of yours with DDP on gloo,
    examples/own_loop.py): the same exit, after your own files are closed (atexit handlers do not run).
    In a worker forked by the launcher's forkserver (`launch.worker`, `returns_to_agent`) code 0 returns: such a
    process ends with os._exit once its function has returned, without finalization, and the agent counts the
    worker done only when its return value has arrived (an exit before it would hang the agent); our threads
    that may be stuck are daemons, which that exit does not wait for.
    """
    if not (_stuck_threads or _had_group or _kept_groups or ran_group):
        return
    if code == 0 and returns_to_agent:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def pick_device(choice: str) -> torch.device:
    """This rank's device for `train.device` (auto, cpu, cuda), made the current CUDA device: call it before
    `init` and before anything else touches CUDA (`bind_device`)."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device is cuda but no CUDA device is visible; set --set train.device=cpu or auto.")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return bind_device(env_info())
    return torch.device("cpu")


def bind_device(info: DistInfo) -> torch.device:
    """One GPU per rank, torchrun's layout: `cuda:LOCAL_RANK`, made this process's current device before the
    process group exists. Why current, not only given: `init_process_group(device_id=)` binds the group to the
    device but leaves the current device at 0; torch's object collectives (`all_gather_object`,
    `broadcast_object_list`) marshal on `torch.cuda.current_device()` "and it is the user's responsibility to
    ensure that this is set so that each rank has an individual GPU" (torch.distributed's docs); so do a barrier,
    pinned memory, an index-less `"cuda"`, and the DataLoader's pin thread (it takes the device current where its
    iterator is made). More local workers than visible GPUs is one sentence (NCCL would refuse two ranks on one
    GPU, "Duplicate GPU detected", after the rendezvous). The current device is per thread: the one thread of ours
    that runs CUDA work (the comm hook's, comm/hook.py) enters `torch.cuda.device` of its buffer."""
    count = torch.cuda.device_count()
    if info.local_world_size > count or info.local_rank >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise UserError(f"{info.local_world_size} workers on this node but it shows {count} GPU"
                        f"{'' if count == 1 else 's'}{shown}, and each worker needs a GPU of its own; start at most "
                        f"{count} per node (--nproc-per-node {count}), or set train.device=cpu.")
    device = torch.device("cuda", info.local_rank)
    torch.cuda.set_device(device)
    return device


def configure_backends(device: torch.device, deterministic: bool) -> None:
    """On CUDA, cuDNN benchmarks its convolution algorithms for each new shape and keeps the fastest
    (`torch.backends.cudnn.benchmark`; the first step of a shape pays for it), unless the run asks for
    deterministic algorithms. Nothing changes on other devices."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not deterministic


def cores_here() -> int:
    """The cores this process may run on (its affinity: taskset, a cpuset), else the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads(threads: int | None, local_world_size: int) -> int:
    """Intra-op threads per worker: `threads` (train.threads) when given; else the environment's OMP_NUM_THREADS
    when it is a whole number >= 1 (torch's own rule, which a user who set it expects, and what the launcher
    gives each worker); else this process's cores / local workers. Never more threads than cores: OpenMP
    threads that outnumber the free cores spin at their barriers, and a step slows several times over, not
    twice (a 2-thread run beside other work measured 8x a 1-thread one; docs/reliability.md)."""
    if threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        threads = int(env) if env.isdigit() and int(env) >= 1 else max(1, cores_here() // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


def wrap_ddp(model: torch.nn.Module, device: torch.device, bucket_mb: float) -> torch.nn.Module:
    """DistributedDataParallel with gradients as bucket views and no buffer broadcast each forward: BN
    statistics stay per worker during training (Goyal et al.) and are averaged before evaluation and
    checkpoints. torch >= 2.13 spells that keyword forward_sync_buffers (broadcast_buffers is deprecated
    there); older releases broadcast_buffers."""
    import inspect

    ddp_cls = torch.nn.parallel.DistributedDataParallel
    params = inspect.signature(ddp_cls.__init__).parameters
    no_broadcast: dict[str, Any] = ({"forward_sync_buffers": False} if "forward_sync_buffers" in params
                                    else {"broadcast_buffers": False})
    return ddp_cls(model, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=bucket_mb,
                   gradient_as_bucket_view=True, **no_broadcast)


def gather_union(items: list[str], world_size: int) -> list[str]:
    """The sorted union of every rank's `items` (all ranks call it; a no-op for one process)."""
    if world_size > 1:
        lists: list = [None] * world_size
        dist.all_gather_object(lists, items)
        items = [x for part in lists for x in part]
    return sorted(set(items))
