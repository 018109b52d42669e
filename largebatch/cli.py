"""`largebatch` command line: a thin dispatcher.

Each command lives in its own module with `main(argv: list[str]) -> int` (or a named
function, "module:function"), which parses its own arguments. Only the chosen module is
imported, so `largebatch plan` does not pay for importing the trainer, and each command
owns its flags.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import NoReturn

from largebatch.errors import UserError, describe_os_error, report

# command -> (module, one-line description). Two-word commands ("bench train") are
# looked up first.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("largebatch.commands.train", "train a model with a recipe (one process or many)"),
    "evaluate": ("largebatch.commands.evaluate", "re-evaluate a finished run from its checkpoints or snapshots"),
    "config": ("largebatch.commands.config", "every config key: type, default, bounds, doc (and a recipe's values)"),
    "plan": ("largebatch.commands.plan", "predict step time, scaling efficiency, time-to-train and cost"),
    "bench train": ("largebatch.commands.bench.train", "training images/s: largebatch against a plain PyTorch loop"),
    "bench data": ("largebatch.commands.bench.data", "data pipeline images/s: largebatch against plain Pillow"),
    "bench allreduce": ("largebatch.commands.bench.allreduce", "all-reduce bus bandwidth per algorithm"),
    "bench optim": ("largebatch.commands.bench.optim", "optimizer step time: LARS / LAMB against torch SGD"),
    "bench speedrun": ("largebatch.commands.bench.speedrun", "Fashion-MNIST time-to-accuracy of a plain PyTorch CNN baseline"),
    "bench scaling": ("largebatch.commands.bench.scaling", "weak-scaling efficiency 1 -> N workers per algorithm"),
    "emulate hosts": ("largebatch.commands.emulate_hosts",
                      "emulate a cluster on this machine: separate hosts made of network namespaces (root)"),
    "study": ("largebatch.commands.experiment", "run an experiment file (experiments/*.yaml): its studies in order"),
    "study batch-scaling": ("largebatch.commands.study.runner:batch_scaling",
                            "top-1 against global batch per optimizer"),
    "study batch-control": ("largebatch.commands.study.runner:batch_control",
                            "batch-size control against a fixed large batch at equal epochs"),
    "study ensemble": ("largebatch.commands.study.runner:ensemble",
                       "the Collapsed Ensemble against one model at equal epochs"),
    "data pack": ("largebatch.commands.data.pack", "pack an ImageFolder into sequential tar shards"),
    "data index": ("largebatch.commands.data.index",
                   "count the samples of WebDataset shards into an index.json beside them"),
    "chaos": ("largebatch.commands.chaos", "kill workers at random during a run and check it survives"),
}

# old command -> its new name: refused with one sentence naming the new one
RENAMED = {"cluster run": "emulate hosts"}


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: largebatch COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "Run 'largebatch COMMAND --help' for the arguments of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        from largebatch import __version__

        print(__version__)
        return 0
    old = next((name for name in RENAMED if argv[0] == name.split()[0]), None)   # a group word that is gone
    if old is not None:
        print(f"largebatch: error: '{old}' is now 'largebatch {RENAMED[old]}' ({COMMANDS[RENAMED[old]][1]}); "
              "a real cluster runs 'largebatch train' under torchrun on each node (docs/multinode.md).",
              file=sys.stderr)
        return 2
    for words in (2, 1):
        name = " ".join(argv[:words])
        if len(argv) >= words and name in COMMANDS:
            module_name, _ = COMMANDS[name]
            rest = argv[words:]
            break
    else:
        subs = [c for c in COMMANDS if c.split()[0] == argv[0] and " " in c]
        if subs:   # a group word alone or with an unknown second word, e.g. `largebatch bench`
            given = f" {argv[1]!r}" if len(argv) > 1 and not argv[1].startswith("-") else ""
            print(f"largebatch: error: '{argv[0]}' needs a subcommand{' (not' + given + ')' if given else ''}; "
                  f"choose one of: {', '.join(subs)}.", file=sys.stderr)
            return 2
        groups = sorted({c.split()[0] for c in COMMANDS})
        print(f"largebatch: error: unknown command {' '.join(argv[:2])!r}; "
              f"choose one of: {', '.join(groups)} (see 'largebatch --help').", file=sys.stderr)
        return 2
    code = _run(module_name, rest)
    dist = sys.modules.get("largebatch.dist")
    if dist is not None:   # a process that ran a process group exits without finalization (dist.end_process)
        dist.end_process(code)
    return code


# The packages every command imports; a user's file named like one of them must not take its place
DEPENDENCIES = ("torch", "numpy", "yaml", "rich", "PIL", "matplotlib")


def check_shadowed() -> None:
    """A file or folder of the user's named like a package largebatch needs (`yaml.py` or `numpy/` in the working
    directory under `python -m`, or on PYTHONPATH) would be imported in the installed package's place and fail deep
    inside with a traceback: one sentence naming it. Only where the installed package is found further down
    sys.path, so a package that is really installed from a checkout is left alone."""
    import importlib.machinery
    import importlib.util

    for name in DEPENDENCIES:
        if name in sys.modules:   # already imported (a warm process): what it is
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        origin = getattr(spec, "origin", None) if spec is not None else None
        if not origin:
            continue
        path = Path(origin)
        entry = path.parent if path.name != "__init__.py" else path.parent.parent   # the sys.path entry it is in
        rest = [p for p in sys.path if Path(p or ".").resolve() != entry.resolve()]
        installed = importlib.machinery.PathFinder.find_spec(name, rest)
        if installed is not None and installed.origin and Path(installed.origin) != path:
            shown = path if path.name != "__init__.py" else path.parent
            raise UserError(f"{shown} is imported as the package {name} that largebatch needs, since {entry} comes "
                            f"first on Python's path; rename it, or run from another directory (or take {entry} out "
                            "of PYTHONPATH).")


def run(argv: list[str] | None = None) -> NoReturn:
    """The `largebatch` program (its console script and `python -m largebatch`): `command_code`, then `exit_now`."""
    try:
        check_shadowed()
    except UserError as err:
        exit_now(report(err))
    exit_now(command_code(argv))


def command_code(argv: list[str] | None = None) -> int:
    """`main`'s exit code, argparse's SystemExit included (--help: 0); a SystemExit with a message is raised on."""
    try:
        return main(argv)
    except SystemExit as exc:
        if exc.code is not None and not isinstance(exc.code, int):
            raise
        return exc.code or 0


def exit_now(code: int) -> NoReturn:
    """End the process with `code` the way Python's exit does (`flush_at_exit`: our running threads waited for, the
    atexit handlers run, stdout and stderr flushed), without the interpreter's finalization: with torch imported,
    tearing down its thousands of modules and objects costs 0.5-1 s of CPU after the command has finished (about
    1 s in a process forked from one that imported torch: every object it touches is copied). Everything a
    command writes is closed by then; a process that ran a process group has ended before this (`dist.end_process`).
    (1) A process that ran torch's elastic agent (a launcher) takes Python's own exit: under the suite's load one
    node agent of `emulate hosts` printed a traceback from a weakref finalizer through this exit, not explained
    (`launch._quiet_keep_alive_join` is one such source)."""
    launch = sys.modules.get("largebatch.launch")
    if launch is not None and launch.ran_agent:
        sys.exit(code)   # (1)
    os._exit(flush_at_exit(code))


def flush_at_exit(code: int = 0) -> int:
    """What Python's exit does before finalization: our running (non-daemon) threads waited for, the atexit
    handlers run, then stdout and stderr flushed; the exit code (120 where stdout could not be written, as Python's
    exit gives it)."""
    import atexit
    import contextlib
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()

    atexit._run_exitfuncs()   # what finalization runs first
    try:
        for stream in (sys.stdout, sys.__stdout__):
            if stream is not None:
                stream.flush()
    except Exception as err:   # noqa: BLE001 - e.g. a full disk under `> file`: as Python's exit, code 120
        with contextlib.suppress(Exception):
            print(f"largebatch: error: writing the output failed ({err}).", file=sys.stderr)
        code = code or 120
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    return code


def _run(module_name: str, rest: list[str]) -> int:
    try:
        module_name, _, function = module_name.partition(":")   # "module" or "module:function"
        module = importlib.import_module(module_name)
        return int(getattr(module, function or "main")(rest) or 0)
    except UserError as err:
        return report(err)
    except OSError as err:   # a path the user gave: unreadable, read-only, full disk, a file for a directory
        return report(UserError(describe_os_error(err)))
    except KeyboardInterrupt:
        print("largebatch: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        # A failed collective, already explained (region, step, the ranks that did not arrive): one line.
        if type(err).__name__ != "CollectiveTimeout":
            raise
        print(f"largebatch: error: {err}", file=sys.stderr, flush=True)
        return 1


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad command lines as one sentence and exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UserError(f"{self.prog}: {message} (see '{self.prog} --help').")


def check_numbers(*checks: tuple[str, float, bool, str]) -> None:
    """(flag, value, ok, requirement) each: the first that is not ok becomes one sentence naming that flag
    alone, e.g. ``--steps is 0; give 1 or more.``"""
    for flag, value, ok, need in checks:
        if not ok:
            raise UserError(f"{flag} is {value}; give {need}.")


def check_output_path(flag: str, path: str | Path | None, directory: bool = False) -> None:
    """Before any work, in a dry run too: the file (or, with `directory`, the directory) `path` that a
    command writes can be made there, so a bad path neither costs the run nor is promised by a dry run.
    Creates nothing: the nearest existing folder above it must be a writable directory. (A command's own
    directory must also be no system directory nor the home directory: `rundir.refuse_system`, which the
    commands call, as this base layer imports no runtime module.)"""
    if not path:
        return
    path = Path(path)
    if not directory and path.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file path.")
    folder = path if directory else path.parent
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"{flag} {path}: {probe} is a file, not a directory; move it or give another {flag}.")
    if not os.access(probe, os.W_OK):
        raise UserError(f"{flag} {path}: {probe} is not writable; give a path in a writable directory.")
