"""Starting workers: torch's elastic agent (torchrun), run in this process, with largebatch's exit codes.

Every command that starts workers on this host builds the torchrun arguments with `local_workers` and runs
them with `run_agent` (`largebatch train` with --nproc-per-node 2 or more or with restarts, `evaluate` with
--nproc-per-node 2 or more, `bench allreduce`; one worker without restarts runs in the launching process), or
through `python -m largebatch.launch TORCHRUN_ARGS` where the agent must be its own process (`emulate hosts`
starts one per namespaced host). What it adds to torchrun:

1. Exit codes: 2 when a worker exited 2 (it printed the user's one-sentence error; the peers that the
   agent stopped after it exit otherwise), 128 + N when the agent itself got signal N, else the workers'.
2. Quiet: the agent's warning for each worker it stops and its error box for each failure would bury
   the worker's own sentence, so they are off and a failure that is not a user error gets one line
   per worker instead.
3. The end of the run on another node: torch's agent ends without waiting for the others when its own
   workers fail, and the agent that hosts the rendezvous store (node 0) takes the store with it. Every
   other agent then meets a closed connection at its next check of the store; torchrun prints a
   traceback there (and, from C++, 40 lines of stack frames per failed store call). Here it is one line
   naming the store and its node, exit code EXIT_STORE_LOST (3), and this node's workers stopped (the agent
   stops them on its way out). The code says "ended because another node did": whoever gathers the nodes'
   codes (`emulate hosts`) reports the host's own code, which says why, and may see this one first (the host's
   process still tears down after its store is gone). Not all nodes at the rendezvous in time is a user
   error (wrong --nnodes or endpoint).
4. Workers started warm (`_launch_warm`): for `-m largebatch` workers the agent forks each one from a
   forkserver of this launch that imported torch once, instead of starting N interpreters that each import it
   (`import torch, torch._dynamo, torch.distributed.run` is 5.1 s of CPU on a 2-core AMD EPYC); a restart forks
   again with no import. The forkserver itself is a fork of this launcher, which has imported torch already,
   made what a fresh interpreter would be (`fork_forkserver`), where that is safe: one thread (numpy's BLAS
   pool starts none with OMP_NUM_THREADS=1, as in the suite) and no CUDA driver in this process; else
   multiprocessing spawns it and it imports torch. Each worker is what torchrun would start: started apart
   with setsid, line-buffered output, the program's exit code, a traceback on stderr. The forkserver and
   multiprocessing's resource tracker are stopped when the agent ends, so a launcher leaves no process behind.
   Any other torchrun command line (--no-python, a script) runs as torchrun runs it.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from largebatch.errors import UserError, report

EXIT_STORE_LOST = 3   # step 3: this node ended because the host of the rendezvous store did (or the network failed)
AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")
ran_agent = False   # this process ran torch's elastic agent: it ends through Python's own exit (cli.exit_now)


def free_port() -> int:
    """A free TCP port on loopback for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_options(argv: list[str], *flags: str) -> list[str]:
    """`argv` minus each `--flag VALUE` / `--flag=VALUE` of `flags` (the launcher's own, not the workers')."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


def check_worker_count(flag: str, nproc: int, low: int = 1) -> None:
    """A count of local workers a user gave: at least `low`, and at most 8 per core (64 at least) - each
    worker is a whole Python process with torch loaded, and 100,000 of them would exhaust the host before
    the launcher could stop them. A larger world is planned with `train --dry-run --world-size N`."""
    import os

    cores = os.cpu_count() or 1
    most = max(64, 8 * cores)
    if nproc < low:
        raise UserError(f"{flag} is {nproc}; give {low} or more workers.")
    if nproc > most:
        raise UserError(f"{flag} is {nproc}; this host has {cores} cores, so give at most {most} local workers "
                        "(plan a larger world with largebatch train --dry-run --world-size N).")


def local_workers(nproc: int, command: list[str], max_restarts: int = 0) -> list[str]:
    """The torchrun arguments of `nproc` workers on this host running `python -m largebatch COMMAND...`,
    rendezvous on loopback, for `run_agent`; sets OMP_NUM_THREADS to the cores per worker unless the user set it.
    The rendezvous is torchrun --standalone's: the agent's store binds a free port itself (port 0) and the run has
    an id of its own. A port chosen here and bound later by the agent could be taken in between by another launch
    on this host, whose store torch's c10d backend then joins as a client (it falls back to that when it cannot
    bind): the two launches shared a rendezvous and one waited out the other's exit barrier (300 s)."""
    import os
    import uuid

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))   # this process's cores (dist.cores_here)
    return ["--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", uuid.uuid4().hex, "--local-addr", "127.0.0.1",
            "--max-restarts", str(max_restarts), "-m", "largebatch", *command]


def quiet_agent_logs() -> None:
    """Step 2. torch's elastic modules give their loggers a level of their own (LOGLEVEL, WARNING by default),
    which a parent's level does not override: set it on each one that exists (call after importing torchrun)."""
    names = [n for n in list(logging.root.manager.loggerDict)
             if any(n == p or n.startswith(p + ".") for p in AGENT_LOGGERS)]
    for name in {*AGENT_LOGGERS, *names}:
        _QUIETED.setdefault(name, logging.getLogger(name).level)   # the level a forked forkserver gets back
        logging.getLogger(name).setLevel(logging.CRITICAL)


_QUIETED: dict[str, int] = {}
# False where this process imported torch with an environment its workers do not get (`main` where libc10's level
# cannot be set: the agent's C++ log level from TORCH_CPP_LOG_LEVEL): its forkserver is then spawned, not forked
# (`fork_forkserver`)
torch_as_workers_import_it = True
# `main`: the C++ log level the workers' import of torch gives, which the agent raised for itself after importing
# torch as they do; a forked forkserver sets it back (`_as_spawned`)
_workers_cpp_log_level: int | None = None


def cpp_log_level() -> Any:
    """c10's C++ log threshold as a ctypes int: `FLAGS_caffe2_log_level` in torch's libc10, which torch sets from
    TORCH_CPP_LOG_LEVEL at import and each C++ log call reads (0 INFO .. 3 FATAL; a call below it logs nothing);
    None where that library does not export it. Found without importing torch (before it, the library is loaded
    alone; torch's import then takes that copy and sets the level in it)."""
    import ctypes
    import importlib.util
    import os

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(spec.origin), "lib", "libc10.so"))
        return ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None


def failed_exit_code(exc) -> int:
    """Step 1 for torchrun's ChildFailedError."""
    failures = getattr(exc, "failures", {}) or {}
    codes = [f.exitcode for f in failures.values()]
    if 2 in codes:
        return 2
    for rank, f in sorted(failures.items()):
        if f.exitcode < 0 and -f.exitcode in signal.valid_signals():
            how = f"signal {signal.Signals(-f.exitcode).name}"
        else:
            how = f"exit code {f.exitcode}"
        print(f"largebatch: worker rank {rank} (pid {f.pid}) failed with {how}; its output is above.",
              file=sys.stderr, flush=True)
    return 1


def option_value(argv: list[str], flag: str, default: str = "") -> str:
    """The value of `--flag VALUE` / `--flag=VALUE` in `argv` (the last one given), else `default`."""
    value = default
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1:]
    return value


def rendezvous_failure(exc: Exception, torchrun_args: list[str]) -> int:
    """Step 3: one line for a rendezvous that failed under a running agent; the exit code."""
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    endpoint = option_value(torchrun_args, "--rdzv-endpoint", "its default endpoint")
    if isinstance(exc, RendezvousTimeoutError):
        nnodes = option_value(torchrun_args, "--nnodes", "1")
        raise UserError(f"not all of the --nnodes {nnodes} nodes reached the rendezvous at {endpoint} in time; "
                        "start the same command on every node, with the same --nnodes, --rdzv-endpoint and "
                        "--rdzv-id.") from None
    node = option_value(torchrun_args, "--node-rank", "")
    here = f"node {node}" if node else "this node"
    print(f"largebatch: {here} lost the rendezvous store at {endpoint}: the agent that hosts it has ended "
          f"(its node's output says why) or the network to it failed; {here}'s workers were stopped.",
          file=sys.stderr, flush=True)
    return EXIT_STORE_LOST


def _quiet_keep_alive_join() -> None:
    """torch's rendezvous keeps itself alive with a `_PeriodicTimer` whose weakref finalizer joins the timer's
    thread. An agent that ends by a signal leaves the timer running (torch keeps the rendezvous open for a
    restart), and when the garbage collector happens to collect it on that very thread, the join raises
    "cannot join current thread", which Python prints as a traceback ("Exception ignored in: <finalize
    object; dead>") under the run's own one-line ending; the thread ends either way. This process's hook for
    unraisable exceptions drops exactly that one and passes every other on to the hook it replaces."""
    import os
    import traceback

    previous = sys.unraisablehook
    if getattr(previous, "largebatch_keep_alive", False):
        return

    def hook(unraisable) -> None:
        torch_timer = any(f.f_code.co_name == "_stop_thread" and
                          f.f_code.co_filename.endswith(os.path.join("elastic", "rendezvous", "utils.py"))
                          for f, _ in traceback.walk_tb(unraisable.exc_traceback))
        if not (isinstance(unraisable.exc_value, RuntimeError) and torch_timer
                and "cannot join current thread" in str(unraisable.exc_value)):
            previous(unraisable)

    hook.largebatch_keep_alive = True   # type: ignore[attr-defined]
    sys.unraisablehook = hook


def run_agent(torchrun_args: list[str]) -> tuple[int, int | None]:
    """Run torchrun with `torchrun_args` in this process; (exit code, signal number if the agent was
    signalled, else None)."""
    global ran_agent
    ran_agent = True
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.run import main as torchrun_main

    quiet_agent_logs()
    _quiet_keep_alive_join()
    try:
        if not _launch_warm(torchrun_args):
            torchrun_main(torchrun_args)
    except SystemExit as exc:   # torchrun exits through sys.exit
        return int(exc.code or 0), None
    except (RendezvousConnectionError, RendezvousTimeoutError, DistNetworkError) as exc:
        # DistNetworkError: the same loss met outside the rendezvous backend (the agent's rank assignment
        # reads the store directly)
        return rendezvous_failure(exc, torchrun_args), None
    except Exception as exc:
        name = type(exc).__name__
        if name == "SignalException":   # the agent was signalled; it stopped the workers
            signum = int(getattr(exc, "sigval", signal.SIGTERM))
            return 128 + signum, signum
        if name == "ChildFailedError":
            return failed_exit_code(exc), None
        raise
    return 0, None


# Step 4: what the forkserver imports once, before it forks each worker (not largebatch: it reads its environment
# when it imports, and a worker's environment is set after the fork)
WORKER_PRELOAD = ("largebatch.forkserver_session", "numpy", "torch", "torch._dynamo", "torch.distributed",
                  "torch.distributed.elastic.multiprocessing")


def _launch_warm(torchrun_args: list[str]) -> bool:
    """Step 4: run torchrun's agent with `-m largebatch ARGS` workers forked from a forkserver that imported torch
    once (`WORKER_PRELOAD`); False (nothing run) for any other torchrun command line, which torchrun runs as given.
    The forkserver is this launch's own: started at the first worker, with this process's environment and output,
    and stopped when the agent has ended."""
    import multiprocessing
    import tempfile

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(torchrun_args)
    if len(tempfile.gettempdir()) > 64:   # the forkserver's socket, TMPDIR/pymp-*/listener-*, must fit sun_path
        return False
    if (args.no_python or not args.module or args.training_script != "largebatch" or args.standalone
            or args.rdzv_backend == "static"):
        return False
    config, _, _ = config_from_args(args)   # sets OMP_NUM_THREADS for the workers where torchrun would
    config.start_method = "forkserver"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(WORKER_PRELOAD))
    try:
        fork_forkserver(config)
        elastic_launch(config=config, entrypoint=worker)(list(args.training_script_args))
    finally:
        stop_forkserver(sys.exc_info()[1])
    return True


def fork_forkserver(config=None) -> bool:
    """Step 4 (and a study's cells, `cells.start_cell`, with no CONFIG): start this process's forkserver as a fork
    of this process, which has imported torch already, where
    that is safe (`_fork_is_safe`: one thread, no CUDA driver) and this process imported torch as its workers
    would (`torch_as_workers_import_it`); False: multiprocessing starts it at the first
    worker, as a fresh interpreter that imports `WORKER_PRELOAD` (the same code, `forkserver.main`). It is
    multiprocessing's own start of the forkserver (`ForkServer.ensure_running`: its socket, its "alive" pipe, its
    record of the server) with a fork in place of the interpreter it spawns; the fork first becomes what that
    interpreter would be (`_as_spawned`). The environment is the workers' as it would be at the first worker's
    start: torch's `launch_agent` sets TORCHELASTIC_SIGNALS_TO_HANDLE before it, so that is set here first."""
    import gc
    import multiprocessing.forkserver as forkserver
    import os
    from multiprocessing import resource_tracker, util

    server = getattr(forkserver, "_forkserver", None)
    if not (torch_as_workers_import_it and _fork_is_safe() and hasattr(server, "_lock")
            and hasattr(util, "spawnv_passfds")):
        return False
    signals = getattr(config, "signals_to_handle", None)
    if isinstance(signals, str):
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals
    gc.collect()   # what this process would still finalize is finalized here, not in the fork
    for stream in (sys.stdout, sys.stderr):   # nothing buffered here is written again by the fork's children
        with contextlib.suppress(Exception):
            stream.flush()
    resource_tracker.ensure_running()   # an interpreter of its own, as ever (ensure_running starts it first)
    spawn = util.spawnv_passfds
    util.spawnv_passfds = _fork_as_spawned
    try:
        server.ensure_running()   # type: ignore[union-attr]
    except Exception:   # noqa: BLE001 - no fork (memory, a process limit) or another multiprocessing: it spawns
        return False    # the forkserver at the first worker (a fork that started has its "alive" pipe closed)
    finally:
        util.spawnv_passfds = spawn
    return True


def _fork_is_safe() -> bool:
    """Whether this process may fork its forkserver: one thread (a fork copies only the calling one, and any lock
    another held stays held), and no CUDA driver loaded (a CUDA context does not survive a fork; torch loads
    libcuda at the first CUDA call, e.g. torch.cuda.is_available(), not at import). numpy's OpenBLAS starts its
    thread pool when numpy is imported unless OMP_NUM_THREADS or OPENBLAS_NUM_THREADS is 1, so on a machine of
    several cores a launcher without either spawns its forkserver."""
    import os

    try:
        if len(os.listdir("/proc/self/task")) != 1:
            return False
        with open("/proc/self/maps") as maps:
            return not any("libcuda.so" in line for line in maps)
    except OSError:
        return False


FORKSERVER_NAME = "lb-forkserver"   # the forked forkserver's process name (/proc/PID/comm)


def _fork_as_spawned(path: Any, args: Sequence[Any], passfds: Sequence[int]) -> int:
    """`multiprocessing.util.spawnv_passfds(path, args, passfds)` by a fork: the child runs `args`' `-c` code (the
    forkserver's main) as `python -c` would, after `_as_spawned`; the parent gets its pid."""
    import os

    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _as_spawned(passfds)
        exec(args[-1], {"__name__": "__main__"})   # main(...) serves until the launcher's "alive" pipe closes
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:   # noqa: BLE001 - printed as python -c would
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _as_spawned(passfds: Sequence[int]) -> None:
    """In the forked forkserver: what a fresh `python -c` interpreter would have instead of this launcher's state.
    Python's signal dispositions and hooks, no profile or trace function, no atexit handler, the agent's loggers
    at their own levels, multiprocessing's forkserver lock free (the launcher held it at the fork), no largebatch
    module (each worker imports largebatch afresh, as from a spawned forkserver, with none of the launcher's
    module state) and an empty __main__, argv ["-c"], only `passfds` and the standard streams open, its process
    named FORKSERVER_NAME. What the launcher still holds in its frames is frozen (gc.freeze), never finalized
    here: its files' numbers may be reused by the workers."""
    import atexit
    import faulthandler
    import gc
    import multiprocessing.forkserver as forkserver
    import os
    import threading
    import types
    from multiprocessing import resource_tracker

    faulthandler.disable()   # its handlers first: a SIG_DFL below would leave it "enabled" with no handler, and
    for sig in signal.valid_signals():   # a worker's faulthandler.enable() (torch's `record`) would then do nothing
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):   # what Python itself ignores at start-up
        signal.signal(sig, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    sys.excepthook, sys.unraisablehook, sys.displayhook = sys.__excepthook__, sys.__unraisablehook__, sys.__displayhook__
    sys.setprofile(None)
    sys.settrace(None)
    threading.setprofile(None)
    threading.settrace(None)
    atexit._clear()
    if os.environ.get("PYTHONFAULTHANDLER") or sys.flags.dev_mode or "faulthandler" in sys._xoptions:
        faulthandler.enable()   # as such an interpreter enables it at start-up
    for name, level in _QUIETED.items():
        logging.getLogger(name).setLevel(level)
    if _workers_cpp_log_level is not None:
        cpp_log_level().value = _workers_cpp_log_level
    forkserver._forkserver._lock = threading.Lock()   # type: ignore[attr-defined]
    tracker: Any = resource_tracker._resource_tracker
    tracker._fd, tracker._pid = None, None   # not this process's child; each worker is handed its pipe
    for name in [n for n in sys.modules if n == "largebatch" or n.startswith("largebatch.")]:
        del sys.modules[name]
    sys.modules["__main__"] = types.ModuleType("__main__")
    sys.argv = ["-c"]
    gc.collect()   # the launcher's objects that the purge freed, finalized while their files are still its own
    keep = sorted({0, 1, 2, *passfds})
    for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
        os.closerange(low + 1, high)
    gc.freeze()
    _set_process_name(FORKSERVER_NAME)


def stop_forkserver(exc: BaseException | None) -> None:
    """The end of `_launch_warm`: the forkserver (a child of this process, in a session of its own) and
    multiprocessing's resource tracker (a child in this process's group) stopped and waited for, so that this
    launcher leaves no process behind when it exits (the tracker would otherwise end only after this process,
    and an orphan is reaped only when the host's init reaps it). First the agent's semaphores
    are released (their finalizers unlink them and tell the tracker; a tracker stopped before that unlinks them
    itself and warns of a leak): the frames of an exception on its way out (ChildFailedError, a signal)
    still hold the agent, so their locals are cleared, as `traceback.clear_frames` does for that purpose."""
    import gc
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker
    import traceback

    if exc is not None:
        traceback.clear_frames(exc.__traceback__)
    gc.collect()
    multiprocessing.forkserver._forkserver._stop()   # type: ignore[attr-defined]
    multiprocessing.resource_tracker._resource_tracker._stop()   # type: ignore[attr-defined]


def worker(argv: list[str]) -> None:
    """A worker of `_launch_warm`, in the process the forkserver forked for it: `python -u -m largebatch ARGV` as
    torchrun would start it. Its own session (torchrun's start_new_session: a Ctrl-C reaches the agent, which
    stops the workers), line-buffered output (-u), an unexpected exception's traceback on stderr and exit code 1,
    and the program's exit (`cli.exit_now`) for any other code than 0. Exit code 0 returns instead: torch's
    agent counts a worker done when its return value has arrived, which happens after this returns (the
    process then ends with os._exit, without the interpreter's finalization)."""
    import os
    import traceback

    os.setsid()
    drop_forkserver_fds()
    _name_worker()
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    from largebatch import cli, dist

    dist.returns_to_agent = True
    sys.argv = [os.path.join(os.path.dirname(cli.__file__), "__main__.py"), *argv]   # as `python -m largebatch`
    try:
        code = cli.command_code(argv)
    except SystemExit as exc:   # one with a message: as Python's exit prints it
        print(exc.code, file=sys.stderr)
        code = 1
    except BaseException:   # noqa: BLE001 - what an uncaught exception does to a program: traceback, code 1
        traceback.print_exc()
        code = 1
    if code:
        cli.exit_now(code)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # torch's _wrap would take a KeyboardInterrupt now for exit 0
    code = cli.flush_at_exit()
    if code:
        os._exit(code)
    _end_after_return()


WORKER_NAME = "lb-w{rank}-r{attempt}"   # the worker's process name (/proc/PID/comm, 15 characters at most)


def _name_worker() -> None:
    """Name this worker's process after its rank and restart attempt (what `ps` and `largebatch chaos` read):
    a forked worker's environment is set after it started, so /proc/PID/environ does not show its RANK."""
    import os

    _set_process_name(WORKER_NAME.format(rank=os.environ.get("RANK", "?"),
                                         attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def _set_process_name(name: str) -> None:
    """This process's name as /proc/PID/comm and `ps` show it (Linux's PR_SET_NAME, 15 bytes at most)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)   # PR_SET_NAME


def _end_after_return() -> None:
    """After a worker's function has returned (code 0), torch's `_wrap` sends the return value to the agent
    through a SimpleQueue, which writes it into a pipe before `put` returns, then waits on an Event for the agent
    to say it has read every worker's value. That wait is for queues with a feeder thread; after a SimpleQueue's
    put the value outlives the process (the agent reads it from the pipe and counts the worker done by its exit
    code). An agent that is stopping its workers (it was signalled; a peer failed) or that died never sets the
    Event: its workers waited out the agent's 30 s close and were SIGKILLed. So the process ends (code 0, its work
    done and flushed) as `_wrap` calls that Event's wait, from a profile hook on the main thread: at the call,
    before the wait takes the Event's process-shared locks (a process that ends inside multiprocessing's
    Condition.wait leaves its lock or its sleeper count taken, and the agent's Event.set blocks for ever)."""
    import os

    def hook(frame, event, arg) -> None:
        if event != "call" or frame.f_code.co_name != "wait":
            return
        caller = frame.f_back
        if (frame.f_code.co_filename.endswith(os.path.join("multiprocessing", "synchronize.py"))
                and caller is not None and caller.f_code.co_name == "_wrap"
                and caller.f_code.co_filename.endswith(os.path.join("elastic", "multiprocessing", "api.py"))):
            os._exit(0)

    sys.setprofile(hook)


def drop_forkserver_fds() -> None:
    """In a worker: close what the forkserver hands every process it forks, the write end of its "alive" pipe
    and multiprocessing's resource tracker's pipe. While a worker held them, a SIGKILLed launcher left the
    forkserver waiting for that pipe to close, so the workers' parent never died and `rundir.watch_parent`
    never stopped them; a worker needs neither (it starts no process through the forkserver)."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker
    import os

    server, tracker = multiprocessing.forkserver._forkserver, multiprocessing.resource_tracker._resource_tracker
    for owner, name in ((server, "_forkserver_alive_fd"), (tracker, "_fd")):
        fd = getattr(owner, name, None)
        if isinstance(fd, int):
            with contextlib.suppress(OSError):
                os.close(fd)
            setattr(owner, name, None)


def main(argv: list[str]) -> int:
    """`python -m largebatch.launch TORCHRUN_ARGS`: an agent in a process of its own (one per node).

    The agent's own C++ warnings are off unless the user set TORCH_CPP_LOG_LEVEL: a store call to a node that
    has ended logs 40 lines of stack frames before the exception that step 3 turns into one line. The agent
    imports torch as its workers do, then raises its own level to ERROR (`cpp_log_level`), which its forked
    forkserver sets back to theirs. Where libc10 does not export the level, the agent imports torch with
    TORCH_CPP_LOG_LEVEL=ERROR (torch reads it once, at import) and the workers get the environment as it was,
    from a spawned forkserver: a fork would keep that level (`torch_as_workers_import_it`)."""
    import os

    global torch_as_workers_import_it, _workers_cpp_log_level
    if os.environ.get("TORCH_CPP_LOG_LEVEL") is None:
        level = cpp_log_level()
        if level is not None:
            import torch  # noqa: F401 - as the workers import it: sets their level

            _workers_cpp_log_level, level.value = level.value, 2   # ERROR (c10's GLOG_ERROR)
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
            import torch  # noqa: F401 - reads the level now

            del os.environ["TORCH_CPP_LOG_LEVEL"]
            torch_as_workers_import_it = False   # a fork of this process would keep its workers' C++ warnings off
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        return run_agent(argv)[0]
    except UserError as exc:
        return report(exc)
    except SignalException as exc:   # a signal on the way out, after the agent's own handling: it ends here
        return 128 + int(exc.sigval)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
