"""`largebatch train [RECIPE] [--set section.key=value ...] [--nproc-per-node N] [--run-dir DIR] [--resume [--allow-change KEY]] [--dry-run]`

One launch path: the program reads the torchrun environment, so
`torchrun --nproc-per-node N -m largebatch train RECIPE` and
`largebatch train RECIPE --nproc-per-node N` (which starts the same workers through
torch's elastic launcher, rendezvous bound to loopback) run the same code.
`--nproc-per-node 1` without restarts is the one process of a plain `largebatch train`: it
trains in this process (an agent and a second interpreter would add only start-up time).
"""
from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from pathlib import Path

from largebatch import config as config_mod
from largebatch.cli import ArgumentParser
from largebatch.errors import UserError, env_int
from largebatch.resume import check_allow_change


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="largebatch train", description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", nargs="?", default="fashion_mnist",
                   help=f"recipe name ({', '.join(config_mod.list_recipes())}) or a YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe key (repeatable), e.g. --set optim.lr=0.2")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="start N local workers through torch's elastic launcher (1, without --max-restarts: train "
                        "in this process)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc-per-node: restart the worker group up to K times after a failure")
    p.add_argument("--run-dir", type=Path, default=None, help="run directory (default runs/<recipe>-<time>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest intact checkpoint of --run-dir (default: the newest run of the recipe)")
    p.add_argument("--allow-change", action="append", default=[], metavar="SECTION.KEY",
                   help="with --resume: accept a change of a setting that is part of what the run is (e.g. data.root "
                        "after the data moved); the change is recorded in the run (repeatable; docs/reliability.md)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved plan and exit")
    p.add_argument("--world-size", type=int, default=None,
                   help="with --dry-run: resolve the plan for this many workers (e.g. 2048)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    return p


def _latest_run(recipe: str) -> Path | None:
    name = Path(recipe).stem
    runs = sorted(Path("runs").glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def check_comm_layout(comm: config_mod.CommConfig, world_size: int, where: str = "the world size") -> None:
    """The layout checks a run makes when its comm hook starts on more than one worker, for --dry-run: a
    comm.grid of X*Y = world size, a comm.local_size that divides it (`where` names where the size came from).
    A grid or node size left to LOCAL_WORLD_SIZE is checked by the run, which knows it."""
    from largebatch.comm.dispatch import check_layout

    if world_size >= 2:   # one worker: no hook, nothing to lay out
        check_layout(comm.algorithm, {"grid": comm.grid, "local_size": comm.local_size}, world_size, where,
                     given_only=True)


def dry_run(cfg: config_mod.Config, world_size: int, where: str = "the world size") -> dict:
    from largebatch import memory, runplan

    check_comm_layout(cfg.comm, world_size, where)
    train_size, info = _train_size(cfg)
    device_type = memory.device_type_for(cfg)
    local = min(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", "8" if device_type == "cuda" else "1")))
    run_plan = runplan.decide(cfg, info, world_size=world_size, local_workers=local, train_size=train_size,
                              device_type=device_type)
    plan, est = run_plan.schedule, run_plan.estimate
    d = plan.describe()
    first = d["phases"][0]
    largest = run_plan.largest_micro_batch
    fits = run_plan.fits()
    how = run_plan.how(cfg)
    return {
        "recipe": cfg.recipe, "model": cfg.model.name, "optimizer": cfg.optim.name,
        "world_size": world_size, "global_batch": first["global_batch"],
        "per_worker_batch": first["per_worker_batch"], "micro_batch": first["micro_batch"],
        "accumulation": first["accumulation"], "peak_lr": first["peak_lr"],
        "warmup_start_lr": d["warmup_start_lr"], "warmup_steps": d["warmup_steps"],
        "steps_per_epoch": first["steps_per_epoch"], "total_steps": d["total_steps"], "epochs": d["epochs"],
        "weight_decay": cfg.optim.weight_decay, "no_decay_bn_bias": cfg.optim.no_decay_bn_bias,
        "decay": cfg.schedule.decay, "label_smoothing": cfg.train.label_smoothing,
        "precision": cfg.train.precision, "train_size": train_size, "phases": d["phases"],
        "ensemble": d["ensemble"],
        "device": (f"{device_type}, {est.device_bytes / memory.GIB:.1f} GiB per worker ({est.device_source})"
                   if est is not None else device_type),
        "memory": ("not estimated (the model does not run on the meta device)" if est is None else
                   est.describe(largest) + ("" if fits else " - DOES NOT FIT: lower batch.micro_batch")),
        "micro_batch_choice": how,
        **({"notes": plan.notes} if plan.notes else {}),
        **({"resolution_phases": cfg.data.resolution_phases} if cfg.data.resolution_phases else {}),
    }


def _train_size(cfg: config_mod.Config):
    """(training images, the data's description: a stand-in where data.train_size spares reading the data)."""
    known = getattr(cfg.data, "train_size", None)
    if known:
        from largebatch.memory import stand_in_info

        known -= cfg.data.val_split or 0
        return min(known, cfg.data.subset or known), stand_in_info(cfg)
    from largebatch.data import build_data

    train, _, info = build_data(cfg.data, cfg.train.seed)
    return len(train), info


def print_plan(plan: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"largebatch train --dry-run: {plan['recipe']}", show_header=False)
    for key, value in plan.items():
        if key not in ("phases", "ensemble", "resolution_phases", "notes"):
            table.add_row(key, f"{value:.6g}" if isinstance(value, float) else str(value))
    Console().print(table)
    if len(plan["phases"]) > 1:
        phases = Table(title="batch phases")
        cols = ["start_epoch", "end_epoch", "global_batch", "per_worker_batch", "accumulation", "peak_lr",
                "steps_per_epoch", "steps"]
        for c in cols:
            phases.add_column(c)
        for ph in plan["phases"]:
            phases.add_row(*[f"{ph[c]:.6g}" if isinstance(ph[c], float) else str(ph[c]) for c in cols])
        Console().print(phases)
    for note in plan.get("notes", []):
        Console().print(f"note: {note}")
    if plan.get("resolution_phases"):
        sizes = ", ".join(f"{p['image_size']} px from epoch {p['start_epoch']}"
                          for p in sorted(plan["resolution_phases"], key=lambda p: p["start_epoch"]))
        Console().print(f"progressive resizing (training batches; evaluation at the data's size): {sizes}")
    if plan.get("ensemble"):
        segs = Table(title="Collapsed Ensemble segments (each ends in a collapse and a snapshot)")
        cols = ["kind", "start_epoch", "collapse_epoch", "end_epoch", "start_step", "collapse_step", "end_step",
                "peak_lr"]
        for c in cols:
            segs.add_column(c)
        for g in plan["ensemble"]:
            segs.add_row(*[f"{g[c]:.6g}" if isinstance(g[c], float) else str(g[c]) for c in cols])
        Console().print(segs)


def launch(args, argv: list[str]) -> int:
    """Start the workers through torch's elastic launcher (torchrun), rendezvous on loopback."""
    from largebatch import rundir
    from largebatch.launch import check_worker_count, local_workers, run_agent, without_options

    check_worker_count("--nproc-per-node", args.nproc_per_node)
    if not 0 <= args.max_restarts <= 1000:
        raise UserError(f"--max-restarts is {args.max_restarts}; give a number from 0 to 1000.")
    run_dir = args.run_dir
    if run_dir is None:
        if args.resume:
            run_dir = _latest_run(args.recipe)
            if run_dir is None:
                raise UserError(f"--resume found no run of {args.recipe!r} under runs/; give --run-dir.")
        else:
            run_dir = Path("runs") / f"{Path(args.recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    rundir.check(run_dir, args.resume)   # refuse before starting workers (rank 0 checks again under the lock)
    worker_argv = without_options(argv, "--nproc-per-node", "--max-restarts", "--run-dir") + ["--run-dir", str(run_dir)]
    launcher = local_workers(args.nproc_per_node, ["train", *worker_argv], args.max_restarts)
    print(f"largebatch: starting {args.nproc_per_node} workers (torchrun {' '.join(launcher[:12])} ...)",
          file=sys.stderr, flush=True)
    code, signum = run_agent(launcher)
    resume_hint = (f"resume with: largebatch train {args.recipe} --nproc-per-node {args.nproc_per_node} "
                   f"--run-dir {run_dir} --resume (and the same --set options)")
    finished = (run_dir / "summary.json").exists()
    if signum is not None:   # the launcher was signalled; the workers stopped gracefully at a checkpoint
        if finished:
            print(f"largebatch: stopped by signal {signum} after the run finished; results in {run_dir}.",
                  file=sys.stderr, flush=True)
        else:
            print(f"largebatch: stopped by signal {signum}; {resume_hint}", file=sys.stderr, flush=True)
        return code
    if code == 0 and not finished:
        # the workers (not this launcher) got SIGTERM / SIGINT and stopped gracefully at a checkpoint
        print(f"largebatch: the workers stopped before the end; {resume_hint}", file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    if code == 0:
        _announce(run_dir)
    return int(code)


def out_of_space(err: OSError, run_dir: Path) -> str:
    """A full disk (or quota) during a run, in one sentence: the file that could not be written and the fix. What
    the run wrote is whole (checkpoints, metrics.jsonl's lines, config.yaml), so --resume continues it."""
    room = "free space within your quota" if err.errno == errno.EDQUOT else "free space on that disk"
    return (f"cannot write {err.filename or f'in run directory {run_dir}'}: {err.strerror or err}; {room} and run "
            f"the same command with --resume --run-dir {run_dir} to continue (what the run wrote is kept), or give "
            "another --run-dir.")


def _announce(run_dir: Path) -> None:
    summary = run_dir / "summary.json"
    if summary.exists():
        from rich.console import Console

        from largebatch.metrics import summary_table

        Console(stderr=True).print(summary_table(json.loads(summary.read_text())))
        plots = f" (plots in {run_dir / 'plots'})" if (run_dir / "plots").is_dir() else ""
        print(f"largebatch: run directory {run_dir}{plots}", file=sys.stderr)


def _check_launch(nproc_per_node: int) -> None:
    """--nproc-per-node inside a launched worker (LOCAL_RANK set): it must agree with the launch, or the run would
    silently have another number of processes than asked; a LOCAL_RANK without WORLD_SIZE is a stale value."""
    from largebatch.dist import check_launcher_env

    local_rank = os.environ["LOCAL_RANK"]
    if "WORLD_SIZE" not in os.environ:
        raise UserError(f"LOCAL_RANK is set ({local_rank!r}) but WORLD_SIZE is not, so no launcher started this "
                        f"process; unset LOCAL_RANK (a value left in the environment) to let --nproc-per-node "
                        f"{nproc_per_node} start the workers.")
    check_launcher_env(f"--nproc-per-node {nproc_per_node} then starts its own workers")
    world = env_int("WORLD_SIZE", 1, low=1)
    local = env_int("LOCAL_WORLD_SIZE", world, low=1)
    if local != nproc_per_node:
        raise UserError(f"--nproc-per-node {nproc_per_node} was given to a process that a launcher started with "
                        f"{local} process(es) per node (LOCAL_WORLD_SIZE); drop --nproc-per-node when launching with "
                        "torchrun, or launch with largebatch train --nproc-per-node alone.")


# A study starting a cell names itself here: the cell's launcher (or single process) then stops, with a checkpoint,
# when the study dies, even by SIGKILL, instead of training on as an orphan (its workers watch the launcher).
STUDY_PID = "LARGEBATCH_STUDY_PID"


def main(argv: list[str]) -> int:
    study = os.environ.pop(STUDY_PID, "")   # for this process only, not inherited by its workers
    if study.isdigit():
        from largebatch.rundir import watch_parent

        watch_parent(int(study))
    args = parser().parse_args(argv)
    cfg = config_mod.load(args.recipe, args.overrides)
    allow_change = tuple(check_allow_change(args.allow_change))
    under_torchrun = "LOCAL_RANK" in os.environ
    if under_torchrun and args.nproc_per_node is not None and not args.dry_run:
        _check_launch(args.nproc_per_node)
    if args.dry_run:
        world = args.world_size if args.world_size is not None else (
            args.nproc_per_node if args.nproc_per_node is not None else env_int("WORLD_SIZE", 1, low=1))
        where = ("--world-size" if args.world_size is not None else
                 "--nproc-per-node" if args.nproc_per_node is not None else "the world size (WORLD_SIZE)")
        if world < 1:   # named as given: --nproc-per-node -1 was reported as --world-size -1
            raise UserError(f"{where} is {world}; give 1 or more workers.")
        plan = dry_run(cfg, world, where)
        if os.environ.get("RANK", "0") == "0":
            print_plan(plan)
            print(json.dumps(plan))
        return 0
    if args.nproc_per_node is not None and not under_torchrun:
        if args.nproc_per_node != 1 or args.max_restarts != 0:
            return launch(args, argv)

    from largebatch.trainer import Trainer

    if under_torchrun:
        from largebatch.rundir import watch_parent

        watch_parent()   # a SIGKILLed launcher stops its workers (SIGTERM: a checkpoint at the next step)
    resume = args.resume or env_int("TORCHELASTIC_RESTART_COUNT", 0) > 0
    run_dir = args.run_dir
    if args.resume and run_dir is None:   # an elastic restart finds its run dir in the store (reliability.py)
        run_dir = _latest_run(cfg.recipe)
        if run_dir is None:
            raise UserError(f"--resume found no run of {cfg.recipe!r} under runs/; give --run-dir.")
    from largebatch import dist as dist_mod

    if run_dir is not None and not under_torchrun:   # one process: refuse before building the data, as `launch` does
        from largebatch import rundir                 # (the trainer checks again under the lock)

        rundir.check(run_dir, resume)
    # The ordered teardown, on every exit path: the Trainer stops and joins its threads (when building
    # fails part-way too, and at the end of fit), then barrier (success only: on an error the peers may
    # be gone) and destroy the groups while the interpreter is alive; cli.main ends the process.
    run_at: Path | None = Path(run_dir) if run_dir else None   # named in a full disk's sentence
    try:
        trainer = Trainer(cfg, run_dir, resume=resume, quiet=args.quiet, allow_change=allow_change)
        run_at = Path(trainer.run_dir)
        summary = trainer.fit()
    except BaseException as err:
        dist_mod.shutdown()
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT) and run_at is not None:
            raise UserError(out_of_space(err, run_at)) from None
        raise
    dist_mod.shutdown(barrier=True, timeout_s=min(cfg.comm.timeout_s, 300.0))
    if not under_torchrun and not summary.get("stopped"):
        _announce(trainer.run_dir)
    if summary.get("stopped") and not under_torchrun:
        return 128 + (summary.get("signal") or 15)   # 143 after SIGTERM, 130 after Ctrl-C
    return 0   # under torchrun a graceful stop exits 0, so the agent does not restart the group
