"""DDP communication hook running a `largebatch.comm` algorithm on each gradient bucket.

DDP's buckets *are* the tensor fusion of Mikami et al. and Horovod: gradients
are packed into flat buckets of ``bucket_cap_mb`` (the trainer's
``comm.bucket_mb``) and each full bucket is handed to the hook during backward.

The hook must not serialise communication behind the backward pass. The
point-to-point algorithms are written with blocking ``wait()``s, so the hook runs
them on **one dedicated communication thread per process** and returns at once
with a ``torch.futures.Future`` that the thread completes. Why a thread:

1. The autograd thread hands the bucket to the thread (a FIFO queue) and
   continues with backward, so communication of bucket ``b`` overlaps the
   computation of the gradients of bucket ``b + 1``, as DDP's own all-reduce does.
2. One worker and a FIFO queue: DDP hands buckets to the hook in bucket order on
   every rank, so every rank issues the bucket collectives in the same order,
   which point-to-point matching and NCCL both require.
3. The hook's traffic runs on its own process group (a copy of DDP's group made
   in `register`), so no message or collective sequence number can interleave with
   collectives that the main thread issues meanwhile on the default group.
4. On CPU (gloo) waits release the GIL and the reduction ``add_`` runs in ATen,
   so the thread costs little. On CUDA the thread issues work on its own CUDA
   stream, made to wait for the bucket's producer with an event; the future is
   created with the device so DDP's consumer stream waits for the result. (CUDA
   streams alone would not do: the algorithms' Python control flow would still
   run on the autograd thread.)
5. The thread divides the summed bucket by the world size (DDP averages); lossy
   compression pre-divides instead (no fp16 overflow) and skips the multiply.

``native``, and ``torus2d`` / ``hierarchical`` with ``impl="native"`` (their default), need none of this: their
steps are the backend's own asynchronous collectives, so the hook issues the first one and returns
its future, chained with ``then`` to the next steps (`largebatch.comm.composed`), as torch's own
``allreduce_hook`` and PowerSGD hook do. No thread is started for them.

The state (`CommHookState`) holds only validated, picklable fields; its process
group, sub-groups and thread are runtime resources that ``__getstate__`` drops,
so the state can be checkpointed and re-installed with `register(ddp_model, state)`.
"""
import queue
import threading
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
import torch.distributed as dist

from largebatch.comm.options import OPTIONS, TWO_LEVEL
from largebatch.comm.dispatch import Spec, mesh_options, resolve, run, setup
from largebatch.comm.compression import get_codec
from largebatch.comm.groups import members
from largebatch.errors import UserError

if TYPE_CHECKING:
    from largebatch.comm.composed import Chain


class CommHookState:
    """Validated hook configuration plus (unpicklable) runtime resources.

    Fields: ``algorithm`` (one of `largebatch.comm.ALGORITHMS` or ``noop``), ``compression``, ``timeout_s``
    and the algorithm options of `largebatch.comm.options.OPTIONS` (``grid``, ``local_size``, ``inter``,
    ``impl``, ``pipeline``, ``small_bytes``; None = the default), validated once by `check_options`.
    `from_config(section)` builds it from a run's ``comm`` section.
    """

    FIELDS = ("algorithm", "compression", *OPTIONS, "timeout_s")

    def __init__(self, algorithm: str = "ring", compression: str = "none", timeout_s: Optional[float] = None,
                 mesh: Any = None, **options: Any) -> None:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"CommHookState got unknown option(s) {', '.join(unknown)}; "
                            f"its options: {', '.join(OPTIONS)}")
        if mesh is not None and algorithm in TWO_LEVEL:   # the layout it stands for, kept as a field (not the mesh)
            options.update(mesh_options(algorithm, mesh, options))
            mesh = None
        self.spec: Spec = check_options(algorithm, compression, {**options, "mesh": mesh})
        self.algorithm, self.compression, self.timeout_s = algorithm, compression, timeout_s
        self.options: dict[str, Any] = {name: options.get(name) for name in OPTIONS}   # as given, None = default
        self._reset_runtime()

    def __getattr__(self, name: str) -> Any:
        """An option as given (``state.grid``); only reached for names that are not attributes."""
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")

    @classmethod
    def from_config(cls, section: Any) -> "CommHookState":
        """The state of a run's ``comm`` config section (`config.CommConfig`): its set fields are the options."""
        return cls(section.algorithm, section.compression, section.timeout_s,
                   **{name: getattr(section, name) for name in OPTIONS})

    @staticmethod
    def needed(section: Any) -> bool:
        """Whether a run's ``comm`` section needs a hook: DDP's own all-reduce is the native algorithm
        uncompressed, so that needs none."""
        return section.algorithm != "native" or section.compression != "none"

    @property
    def chained(self) -> bool:
        """True when the hook chains the backend's futures (no communication thread): ``native`` and the
        native-composed forms, except CUDA buckets on gloo (host-staged on the thread instead)."""
        wants = self.algorithm == "native" or dict(self.spec.options).get("impl") == "native"
        return wants and not self._cuda_on_gloo

    def _reset_runtime(self) -> None:
        self.process_group: Optional[dist.ProcessGroup] = None
        self._queue: Optional[queue.Queue] = None
        self._thread: Optional[threading.Thread] = None
        self._streams: dict = {}
        self._chain: Optional["Chain"] = None
        self._world = 1
        self._cuda_on_gloo = False

    # -- checkpointing: fields only, never the groups or the thread ------------------
    def __getstate__(self) -> dict:
        return {k: getattr(self, k) for k in self.FIELDS}

    def __setstate__(self, fields: dict) -> None:
        type(self).__init__(self, **fields)

    def __repr__(self) -> str:
        return "CommHookState(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.FIELDS) + ")"

    # -- runtime --------------------------------------------------------------------
    def start(self, ddp_group: Optional[dist.ProcessGroup], device: Optional[torch.device] = None) -> None:
        """Collectively create the hook's own group and sub-groups, then start the thread (if one is needed).

        Every rank of the world calls this (from `register`), in the same order. ``device``: where the
        model's gradients live.
        """
        if self.algorithm == "noop" or not (dist.is_available() and dist.is_initialized()):
            return
        self._cuda_on_gloo = (device is not None and device.type == "cuda"
                              and dist.get_backend(ddp_group) == "gloo")
        kwargs: dict[str, Any] = {}
        if self.timeout_s is not None:
            import datetime

            kwargs["timeout"] = datetime.timedelta(seconds=self.timeout_s)
        self.process_group = dist.new_group(ranks=members(ddp_group), **kwargs)
        self._world = len(members(self.process_group))
        opts = dict(self.spec.options)
        if self.chained:
            if self.algorithm != "native":
                from largebatch.comm import composed, hierarchical, torus2d

                if self.algorithm == "torus2d":
                    local, cross, gather = torus2d.setup(self.process_group, self._world, opts["grid"], gather=True)
                    cross_p2p = None
                else:
                    local, cross, gather = hierarchical.setup(self.process_group, self._world, opts["local_size"],
                                                              gather=True)
                    cross_p2p = None if opts["inter"] == "native" else hierarchical.INTER[opts["inter"]]
                self._chain = composed.Chain(local, cross, gather, self.compression, cross_p2p)
            return
        setup(self.algorithm, self.process_group, **opts, compression=self.compression)
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="largebatch-comm", daemon=True)
        self._thread.start()

    def close(self, timeout_s: Optional[float] = None) -> bool:
        """Stop the communication thread (after the queued buckets are done) and join it; True when it
        has ended (False: still inside a collective after ``timeout_s``, e.g. with a dead peer)."""
        if self._thread is not None:
            assert self._queue is not None   # created with the thread
            self._queue.put(None)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
            self._queue, self._thread = None, None
        return True

    def submit_chained(self, buffer: torch.Tensor) -> torch.futures.Future:
        """Average ``buffer`` with the backend's asynchronous collectives, chained by futures (no thread)."""
        small = buffer.numel() * buffer.element_size() < dict(self.spec.options).get("small_bytes", 0)
        if self._chain is not None and not small:
            return self._chain.submit(buffer, self._world)
        codec = get_codec(self.compression, buffer.dtype)          # native, or the small-message fast path
        buffer.div_(self._world)
        wire = buffer.to(codec.wire) if codec.lossy else buffer
        fut = dist.all_reduce(wire, group=self.process_group, async_op=True).get_future()

        def back(f: torch.futures.Future) -> torch.Tensor:
            f.wait()
            if wire is not buffer:
                buffer.copy_(wire)
            return buffer

        return fut.then(back)

    def submit(self, buffer: torch.Tensor) -> torch.futures.Future:
        """Queue an in-place average of ``buffer``; the future completes with ``buffer``."""
        fut: torch.futures.Future
        ready: Optional[torch.cuda.Event]
        if buffer.is_cuda:
            fut = torch.futures.Future(devices=[buffer.device])
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(buffer.device))   # the bucket's producer
        else:
            fut, ready = torch.futures.Future(), None
        assert self._queue is not None   # the hook submits only after `start` created the thread
        self._queue.put((buffer, ready, fut))
        return fut

    def _loop(self) -> None:
        while True:
            assert self._queue is not None   # cleared only after this thread has ended
            item = self._queue.get()
            if item is None:
                return
            buffer, ready, fut = item
            try:
                if ready is None:
                    run(buffer, self.spec, self.process_group, average=True)
                    fut.set_result(buffer)
                else:
                    dev = buffer.device
                    stream = self._streams.setdefault(dev, torch.cuda.Stream(dev))
                    with torch.cuda.device(dev), torch.cuda.stream(stream):
                        stream.wait_event(ready)
                        run(buffer, self.spec, self.process_group, average=True)
                        fut.set_result(buffer)                         # records an event on `stream`
            except BaseException as err:  # noqa: BLE001 - handed to DDP, which re-raises it
                fut.set_exception(err)


def comm_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: average ``bucket`` across ranks with ``state``'s algorithm, asynchronously."""
    buffer = bucket.buffer()
    if state.algorithm == "noop":                  # no communication: local gradients as they are
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    if state.process_group is None:                # world size 1: the average is the bucket
        fut = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    if state.chained:
        return state.submit_chained(buffer)
    return state.submit(buffer)


def check_options(algorithm: str, compression: str, options: dict[str, Any], prefix: str = "") -> Spec:
    """The one validation of a hook's algorithm and options (`CommHookState` and a run's ``comm`` section both
    call it): `dispatch.resolve`, then the hook's own rule (`check_hook`). ``prefix``: how the sentences name
    the options ("comm." for the config section)."""
    spec = resolve(algorithm, {"compression": compression, **options}, allow_noop=True, prefix=prefix)
    check_hook(spec, options, prefix)
    return spec


def check_hook(spec: Spec, given: dict[str, Any], prefix: str = "") -> None:
    """The rule a hook adds to `dispatch.resolve`: ``pipeline`` splits a bucket into pieces for the p2p form
    only. The native-composed hook (the default impl) chains whole buckets, so DDP's buckets are its pieces
    and their size (``comm.bucket_mb``) is the setting; a pipeline given for it is refused, not ignored.
    ``prefix``: how the message names the options ("comm." for a config section)."""
    options = dict(spec.options)
    if given.get("pipeline") is not None and options.get("impl") == "native":
        raise UserError(f"{prefix}pipeline is {given['pipeline']} but {spec.algorithm}'s native implementation "
                        f"(the default {prefix}impl) overlaps whole DDP buckets across its two levels, not pieces of "
                        f"one; remove {prefix}pipeline and make the buckets smaller ({prefix}bucket_mb, DDP's "
                        f"bucket_cap_mb), or set {prefix}impl p2p to pipeline pieces of each bucket.")


def install(ddp_model: torch.nn.Module, section: Any) -> Optional[CommHookState]:
    """Install the hook a run's ``comm`` section asks for on ``ddp_model`` and return its state; None where DDP's
    own all-reduce is the algorithm (native, uncompressed), which needs no hook. Collective, as `register`."""
    if not CommHookState.needed(section):
        return None
    return register(ddp_model, CommHookState.from_config(section))


def register(ddp_model: torch.nn.Module, state: CommHookState) -> CommHookState:
    """Install the hook of ``state`` on ``ddp_model`` (a DDP module) and return the state, started: the one entry
    point, as torch's ``register_comm_hook(state, hook)``. Build the state with `CommHookState` (an algorithm
    and its options, validated there) or `CommHookState.from_config` (a run's ``comm`` section); an unpickled
    state is installed the same way.

    Collective: call on every rank, in the same order as other group creations.
    """
    if not isinstance(state, CommHookState):
        raise TypeError(f"register takes a CommHookState, not {type(state).__name__}; build it with "
                        "CommHookState(algorithm, **options) or CommHookState.from_config(cfg.comm).")
    device = next((p.device for p in ddp_model.parameters()), None)
    state.start(getattr(ddp_model, "process_group", None), device)
    # a DDP module: nn.Module's typing does not know its methods
    cast(torch.nn.parallel.DistributedDataParallel, ddp_model).register_comm_hook(state, comm_hook)
    return state
