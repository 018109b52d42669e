"""Reliability: no silent hangs, prompt graceful stops, a run directory that survives restarts,
a preflight check across ranks, and a fault-injection knob to test all of it for real.

The pieces and the order in which the trainer uses them:

1. Control store. Under torchrun every worker reaches the rendezvous TCPStore at
   MASTER_ADDR:MASTER_PORT (hosted by the elastic agent, which outlives worker restarts).
   `control_store()` opens a client to it; keys live under ``largebatch/<run id>/``.
2. Run directory across restarts. Rank 0 records the run directory it chose in the store
   (`remember_run_dir`); a restarted group (TORCHELASTIC_RESTART_COUNT > 0) started by plain
   `torchrun` without --run-dir reads it back (`remembered_run_dir`) and resumes there.
3. Preflight. Every rank all-gathers (config hash, code version, torch version, world layout,
   data sizes); `preflight()` fails fast with a UserError naming the rank that differs from
   rank 0, or the rank without data.
4. Watchdog. Before each collective-bearing region (a training step, a checkpoint barrier,
   an evaluation) each rank records its sequence number, step and region name: a local write,
   no network traffic, no collective, no device sync. A publisher thread per rank sends the
   latest record to the store when it changed, at most once per `publish_every_s` (default 1 s,
   or world size / 1000 s beyond 1,000 ranks, so the store serves at most ~1,000 writes per
   second however fast the steps are; never more than a quarter of the timeout). The thread
   keeps running while the main thread is blocked in a collective or hung elsewhere, so every
   live rank's record is at most one interval old. When a collective in the region fails (the
   comm.timeout_s timeout fires, or a peer died), `Watchdog.guard` sends this rank's record,
   waits 1.5 intervals for the peers' threads, reads every rank's record and raises
   `CollectiveTimeout` naming the region, the step and the ranks whose record is behind.
5. Stop agreement. SIGTERM, SIGINT, SIGHUP and SIGQUIT (every signal torch's agent forwards, `STOP_SIGNALS`)
   only set a local flag. Each step starts an asynchronous
   1-element MAX all-reduce of that flag before the forward pass (it overlaps the step), and
   each step reads the flag its predecessor started, so every rank agrees to stop after the same
   step even when the signal reached them a step apart. On CUDA the flag reaches the host by a
   copy into pinned memory on a side stream that waits for that all-reduce alone, so the read
   never waits for a training step's kernels (the step has no host sync). The stop is therefore
   one or two step boundaries after the signal; a single process stops at the next one. At an epoch
   end the flag is also all-reduced at once (`asked_anywhere`), before the evaluation: a stop asked
   during the epoch's last step writes its checkpoint without waiting for an evaluation that can
   outlast the agent's 30 s grace period.
6. Fault injection (a documented debugging knob, not a mock): the environment variable
   LARGEBATCH_FAULTS, e.g. ``nan@1:3,hang@1:5,kill@0:7``, makes rank R at step S poison its
   loss with NaN (``nan``), sleep ``hang_s`` seconds before checking in (``hang``), SIGKILL
   itself (``kill``), send itself SIGTERM (``term``) or raise a user error on that rank alone (``error``,
   exit code 2). Steps may be ranges ``3-5``. A fault
   fires only in restart attempt 0 unless suffixed ``/A`` (attempt A) or ``/*`` (every attempt).
7. Teardown. `stop_threads` stops and joins every thread above that touches the store or a group,
   before `dist.shutdown` destroys the groups.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from largebatch.dist import namespace as _namespace, note_stuck_thread as _note_stuck, restart_count
from largebatch.errors import UserError, env_float

FAULTS_ENV = "LARGEBATCH_FAULTS"
HANG_S_ENV = "LARGEBATCH_FAULT_HANG_S"
KINDS = ("nan", "hang", "kill", "term", "error")


# ---------------------------------------------------------------------------------- 1. control store
def control_store(world_size: int, timeout_s: float = 60.0):
    """A client of the launcher's TCPStore (None for a single process or without MASTER_ADDR)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world_size <= 1 or not addr or not port:
        return None
    return dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


# ---------------------------------------------------------------------------------- 2. run directory
def remember_run_dir(store, path: Path) -> None:
    if store is not None:
        store.set(f"{_namespace()}/run_dir", str(path))


def remembered_run_dir(store) -> Path | None:
    key = f"{_namespace()}/run_dir"
    if store is None or not store.check([key]):
        return None
    return Path(store.get(key).decode())


# ---------------------------------------------------------------------------------- 3. preflight
def code_version() -> str:
    """largebatch version plus a hash of its source files (catches different code on different nodes)."""
    from largebatch import __version__

    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return f"{__version__}+{digest.hexdigest()[:12]}"


def preflight(info, *, config_hash: str, train_size: int, test_size: int) -> None:
    """Compare what every rank is about to run; raise a UserError naming the odd rank out."""
    mine = {"host": socket.gethostname(), "config hash": config_hash, "code version": code_version(),
            "torch version": torch.__version__, "world size": info.world_size,
            "local world size": info.local_world_size, "train images": train_size, "test images": test_size,
            "local rank": info.local_rank, "node rank": info.node_rank}
    if not info.distributed:
        reports: list = [mine]
    else:
        reports = [None] * info.world_size   # filled with every rank's dict
        dist.all_gather_object(reports, mine)
    check_reports(reports)


def check_reports(reports: list[dict]) -> None:
    """Step 3 on gathered reports (a pure function, also used by tests)."""
    for rank, rep in enumerate(reports):
        if rep["train images"] == 0:
            raise UserError(f"preflight: rank {rank} on {rep['host']} has no training images; check data.root "
                            "on that node.")
    ref = reports[0]
    for key in ("config hash", "code version", "torch version", "world size", "train images", "test images"):
        odd = [r for r, rep in enumerate(reports) if rep[key] != ref[key]]
        if odd:
            r = odd[0]
            raise UserError(f"preflight: rank {r} on {reports[r]['host']} has {key} {reports[r][key]} but rank 0 has "
                            f"{ref[key]} (ranks differing: {odd}); launch every rank with the same code, recipe, "
                            "--set overrides and data.")
    seen: dict[tuple, int] = {}
    for rank, rep in enumerate(reports):
        where = (rep["host"], rep["node rank"], rep["local rank"])
        if where in seen:
            raise UserError(f"preflight: ranks {seen[where]} and {rank} both claim local rank {rep['local rank']} "
                            f"on {rep['host']}; give each node its own --node-rank and the same --nproc-per-node.")
        seen[where] = rank
        if rep["local world size"] != ref["local world size"] and len({r["host"] for r in reports}) > 1:
            raise UserError(f"preflight: rank {rank} on {rep['host']} runs {rep['local world size']} workers per "
                            f"node but rank 0 runs {ref['local world size']}; use the same --nproc-per-node.")


# ---------------------------------------------------------------------------------- 4. watchdog
class CollectiveTimeout(RuntimeError):
    """A collective failed or timed out; the message names the region, the step and the missing ranks."""


def _is_comm_failure(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(s in text for s in ("timed out", "timeout", "connection closed", "connection reset",
                                   "gloo", "nccl", "broken pipe"))


class Watchdog:
    """Step 4: check-ins recorded locally and published to the control store by a thread; turns a
    failed collective into a named error."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float,
                 publish_every_s: float | None = None) -> None:
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.prefix = f"{_namespace()}/attempt{restart_count()}/checkin"
        self.seq = 0
        if publish_every_s is None:
            publish_every_s = max(1.0, world_size / 1000.0)
        self.publish_every_s = min(publish_every_s, timeout_s / 4)
        self._record = "0|0|start"
        self._sent: str | None = None
        self._lock = threading.Lock()      # one send at a time, and never an older record after a newer one
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None:
            self.flush()                   # every rank's key exists before the first collective
            # daemon only so that a hung store cannot keep a crashed process alive; `close` joins it
            self._thread = threading.Thread(target=self._publish, name="largebatch-watchdog", daemon=True)
            self._thread.start()

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def check_in(self, step: int, region: str) -> None:
        self.seq += 1
        self._record = f"{self.seq}|{step}|{region}"   # local only: the publisher thread sends it

    def flush(self) -> None:
        """Send this rank's latest record now, if the store has an older one."""
        with self._lock:
            record = self._record
            if record != self._sent:
                self.store.set(self._key(self.rank), record)
                self._sent = record

    def _publish(self) -> None:
        while not self._stop.wait(self.publish_every_s):
            try:
                self.flush()
            except Exception:   # the store is gone (its host died); explain() reports that
                return

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop the publisher and join it; True when it has ended.

        It must not outlive this call: a thread that is inside a store call (GIL released) when the
        interpreter finalizes is ended by CPython with pthread_exit, whose unwinding through pybind11's
        noexcept GIL guard calls std::terminate ("terminate called without an active exception", exit
        code -6) after a run that succeeded. docs/reliability.md, "Teardown", has the evidence.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
            self._thread = None
        return True

    def missing(self) -> list[tuple[int, int, str]]:
        """(rank, last step, last region) of every rank whose last check-in is behind this rank's."""
        keys = [self._key(r) for r in range(self.world_size)]
        values = self.store.multi_get(keys)
        out = []
        for r, raw in enumerate(values):
            seq, step, region = raw.decode().split("|", 2)
            if int(seq) < self.seq:
                out.append((r, int(step), region))
        return out

    @contextlib.contextmanager
    def guard(self, step: int, region: str) -> Iterator[None]:
        self.check_in(step, region)
        try:
            yield
        except Exception as exc:
            if self.store is None or not _is_comm_failure(exc):
                raise
            raise self.explain(exc, step, region) from exc

    def explain(self, exc: BaseException, step: int, region: str) -> CollectiveTimeout:
        head = (f"rank {self.rank}: collective in '{region}' at step {step} failed "
                f"(comm.timeout_s={self.timeout_s:g})")
        try:
            self.flush()
            time.sleep(1.5 * self.publish_every_s)   # the peers' publisher threads send their latest records
            late = self.missing()
        except Exception as store_exc:   # the store itself is gone (its host died)
            return CollectiveTimeout(f"{head}; the control store is unreachable too ({store_exc}); "
                                     f"original error: {exc}")
        if late:
            names = ", ".join(f"rank {r} (last seen at step {s} in '{g}')" for r, s, g in late)
            return CollectiveTimeout(f"{head}: ranks that did not arrive: {names}. Original error: {exc}")
        return CollectiveTimeout(f"{head}: every rank arrived, so the collective itself stalled or a peer died "
                                 f"inside it. Original error: {exc}")


# ---------------------------------------------------------------------------------- 5. stop agreement
# Every signal torch's elastic agent forwards to its workers (TORCHELASTIC_SIGNALS_TO_HANDLE's default,
# "SIGTERM,SIGINT,SIGHUP,SIGQUIT"): each is a stop with a checkpoint, not a death that loses the work since the last
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class StopAgreement:
    """Step 5: signals set a local flag; one async MAX all-reduce per step makes every rank agree."""

    def __init__(self, distributed: bool, device: torch.device) -> None:
        self.distributed = distributed
        self.device = device
        self.signum: int | None = None
        self._asked = False                       # a single process: the flag when the step began
        self._pending: list[tuple] = []           # (flag on the host, wait) of started all-reduces, oldest first
        cuda = distributed and device.type == "cuda"
        self._side = torch.cuda.Stream(device) if cuda else None

    def install(self) -> None:
        def handler(signum, frame):
            self.signum = signum
        for sig in STOP_SIGNALS:
            with contextlib.suppress(ValueError):   # not in the main thread
                signal.signal(sig, handler)

    def start(self) -> None:
        """Launch the flag all-reduce (before the forward pass, so it overlaps the step)."""
        self._asked = self.signum is not None
        if not self.distributed:
            return
        flag = torch.full((1,), 1.0 if self._asked else 0.0, device=self.device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        if self._side is None:   # gloo: the flag is host memory once the work is done
            self._pending.append((flag, work.wait))
            return
        host = torch.empty((1,), pin_memory=True)
        with torch.cuda.stream(self._side):   # waits for the flag's all-reduce only, not for the step's kernels
            work.wait()
            host.copy_(flag, non_blocking=True)
            flag.record_stream(self._side)
            done = torch.cuda.Event()
            done.record()
        self._pending.append((host, done.synchronize))

    def asked_anywhere(self) -> bool:
        """Whether any rank has been asked to stop by now: one blocking MAX all-reduce of the flag, at an epoch end
        only (before the evaluation), so that a stop that arrives during the epoch's last step is taken with its
        checkpoint at once, not after an evaluation that can outlast the agent's grace period (30 s, then
        SIGKILL). A single process reads its flag."""
        asked = self.signum is not None
        if not self.distributed:
            return asked
        flag = torch.full((1,), 1.0 if asked else 0.0, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())   # a host sync, once an epoch

    def agreed(self) -> bool:
        """Whether every rank agrees to stop after this step: a single process, whether it was asked before the
        step began; a distributed run, whether any rank was asked before the previous step began (the flag
        that step started, read now, the same on every rank)."""
        if not self.distributed:
            return self._asked
        if len(self._pending) < 2:
            return False
        host, wait = self._pending.pop(0)
        wait()
        return bool(host.item())   # host memory: no device sync

    @staticmethod
    def announce(step: int, recipe: str, world_size: int, run_dir: Path) -> None:
        """After an agreed stop (its checkpoint written): the command that resumes the run."""
        workers = f" --nproc-per-node {world_size}" if world_size > 1 else ""
        print(f"largebatch: stopped by signal at step {step}; checkpoint written. Resume with: "
              f"largebatch train {recipe}{workers} --run-dir {run_dir} --resume (and the same --set options)",
              file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- 6. fault injection
@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    first: int
    last: int
    attempt: int | None   # None: every attempt


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            spec, _, attempt = item.partition("/")
            kind, _, where = spec.partition("@")
            rank, _, steps = where.partition(":")
            first, _, last = steps.partition("-")
            fault = Fault(kind, int(rank), int(first), int(last or first),
                          None if attempt == "*" else int(attempt or 0))
        except ValueError:
            fault = None
        if fault is None or fault.kind not in KINDS:
            raise UserError(f"{FAULTS_ENV} entry {item!r} is not KIND@RANK:STEP[-STEP][/ATTEMPT] with KIND one of "
                            f"{', '.join(KINDS)}; e.g. {FAULTS_ENV}=nan@1:3,kill@0:7.")
        faults.append(fault)
    return faults


class FaultInjector:
    """Step 6: this rank's faults from LARGEBATCH_FAULTS (empty, and free, when it is unset)."""

    def __init__(self, rank: int) -> None:
        attempt = restart_count()
        self.rank = rank
        self.faults = [f for f in parse_faults(os.environ.get(FAULTS_ENV, ""))
                       if f.rank == rank and f.attempt in (None, attempt)]
        # read only when a fault is injected here: the knob's own variables never stop a run that uses none
        self.hang_s = env_float(HANG_S_ENV, 3600.0) if self.faults else 3600.0

    def _hit(self, kind: str, step: int) -> bool:
        return any(f.kind == kind and f.first <= step <= f.last for f in self.faults)

    def before_step(self, step: int) -> None:
        if not self.faults:
            return
        if self._hit("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._hit("term", step):
            os.kill(os.getpid(), signal.SIGTERM)
        if self._hit("hang", step):
            time.sleep(self.hang_s)
        if self._hit("error", step):
            raise UserError(f"injected error at step {step} on rank {self.rank} ({FAULTS_ENV}); unset {FAULTS_ENV}.")

    def poison(self, step: int) -> bool:
        return bool(self.faults) and self._hit("nan", step)


# ---------------------------------------------------------------------------------- 7. teardown
def stop_threads(watchdog: Watchdog | None, comm_state, timeout_s: float = 30.0) -> bool:
    """Step 1 of the ordered teardown (then `dist.shutdown`: barrier, destroy the groups): stop and join every
    thread of ours that touches the control store or a process group (the watchdog's publisher, the comm
    hook's thread, the pipeline's cross-level worker). True when every one ended; one that did not is
    recorded, so that the process exits without interpreter finalization (`dist.end_process`)."""
    joined = True
    if watchdog is not None and not watchdog.close(timeout_s):
        joined = False
        _note_stuck("largebatch-watchdog")
    if comm_state is not None and not comm_state.close(timeout_s):
        joined = False
        _note_stuck("largebatch-comm")
    pipeline = sys.modules.get("largebatch.comm.pipeline")
    if pipeline is not None and not pipeline.shutdown(timeout_s):
        joined = False
        _note_stuck("largebatch-cross")
    return joined


# ---------------------------------------------------------------------------------- overhead measurement
def measure_overhead(steps: int = 2000) -> dict:
    """Per-step cost of the watchdog check-in (local), of one publish (a store `set`, sent at most
    once per publish interval by the thread) and of the stop-flag all-reduce,
    in microseconds; run under torchrun: `torchrun --nproc-per-node 2 -m largebatch.reliability`."""
    from largebatch import dist as dist_mod

    info = dist_mod.init(torch.device("cpu"), 60.0)
    store = control_store(info.world_size)
    dog = Watchdog(store, info.rank, info.world_size, 60.0)
    stop = StopAgreement(info.distributed, torch.device("cpu"))
    if info.distributed:
        dist.barrier()
    t = time.perf_counter()
    for step in range(steps):
        dog.check_in(step, "training step")
    check_in_us = (time.perf_counter() - t) / steps * 1e6
    t = time.perf_counter()
    for step in range(steps):     # what the publisher thread pays per send: one store set
        dog.check_in(step, "training step")
        dog.flush()
    publish_us = (time.perf_counter() - t) / steps * 1e6
    dog.close()
    if info.distributed:
        dist.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        stop.start()
        stop.agreed()
    flag_us = (time.perf_counter() - t) / steps * 1e6
    out = {"rank": info.rank, "world_size": info.world_size, "check_in_us": round(check_in_us, 2),
           "publish_us": round(publish_us, 1),
           "stop_flag_allreduce_us": round(flag_us, 1), "steps": steps}
    dist_mod.shutdown()
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(measure_overhead()))
