"""`largebatch study KIND`: the one runner of every study kind (`kinds.KINDS`); it knows no kind.

1. Check the flags and plan the cells (`plan.py`): every group of the kind at each lr of its --lr-grid (a tuning
   study, with --val-split N holding N training images out, data.val_split), or at the lr its --from-tuning
   studies chose (a final study, on the test set; `tuning.py`), or at the recipe's; every seed.
2. Check every group's plan before anything trains, so an impossible batch fails at once.
3. Take OUT (`directory.take_out`: one study process at a time) and check its files: its settings against the
   stored ones (a resumed study repeats them; its lr grid may grow), its study.json and every planned cell's
   summary.json (`cells.check_files`).
4. Run the cells one after another (`cells.run_cell`), each a `largebatch train` of its own; after every cell write
   OUT/study.json, OUT/study.md and OUT/study.png (`summary.write_outputs`). A finished cell is kept, an
   interrupted one resumes: run the same command again to continue. SIGTERM and SIGINT stop the running cell
   with a checkpoint (`cells.Stop`) and the study exits 128 + the signal.
"""
from __future__ import annotations

import json

from largebatch.cli import check_numbers
from largebatch.commands.study.cells import Stop, check_files, run_cell, stop_cells, stopped
from largebatch.commands.study.directory import SETTINGS, same_study, stored_settings, take_out, write_file
from largebatch.commands.study.kinds import of_args, parser
from largebatch.commands.study.plan import cell_dir, cell_label, check_cells, lr_grid, plan_cells
from largebatch.commands.study.protocol import given
from largebatch.commands.study.summary import machine_time, tables, write_outputs
from largebatch.commands.study.tuning import chosen_lrs_of
from largebatch.config import MAX_EPOCHS
from largebatch.errors import UserError


def run(name: str, argv: list[str]) -> int:
    args = parser(name).parse_args(argv)
    kind = of_args(name, args)   # its protocol: the package's, or --protocol's
    check_numbers(("--seeds", args.seeds, args.seeds >= 1, "1 or more"),                         # step 1
                  ("--nproc-per-node", args.nproc_per_node, args.nproc_per_node >= 1, "1 or more"),
                  ("--micro-batch", args.micro_batch, args.micro_batch >= 1, "1 or more"),
                  ("--epochs", args.epochs, args.epochs is None or 0 < args.epochs <= MAX_EPOCHS,   # nan fails
                   f"a positive number of epochs (at most {MAX_EPOCHS:,})"),
                  ("--val-split", args.val_split, args.val_split is None or args.val_split >= 1,
                   "a number of held-out training images"))
    layout = kind.layout(kind, args)
    tunings = args.from_tuning if kind.grid_per else [p for p in [args.from_tuning] if p]   # repeatable, or one
    if tunings and (args.lr_grid not in (None, []) or args.val_split):
        raise UserError("--from-tuning runs the chosen settings on the test set; leave out --lr-grid and --val-split.")
    cells = plan_cells(layout, args.seeds, lr_grid(args.lr_grid, layout.grid_names), chosen_lrs_of(tunings, kind))
    train_size = check_cells(args, cells)                                                         # step 2

    from rich.console import Console

    console = Console(stderr=True)
    held = take_out(args.out, args.dry_run)                                                       # step 3
    try:
        settings = {k: getattr(args, k) for k in kind.settings}
        settings["from_tuning"] = ", ".join(map(str, tunings)) or None
        if args.protocol is None:   # the package's protocol: recorded as studies before --protocol were
            del settings["protocol"]
        else:                       # what --protocol gave (a file's content, not its path)
            settings["protocol"] = given(args.protocol)
        stored = args.out / SETTINGS
        if stored.exists() and not same_study(stored_settings(stored), settings, layout.grid_names):
            raise UserError(f"{args.out} holds a study with other settings ({stored}); resume it with the same "
                            "arguments (an --lr-grid may only add values), or use another --out.")
        cell_dirs = [cell_dir(args.out, group, lr, seed) for group, lr, seed in cells]
        earlier = check_files(args.out, cell_dirs)   # before any cell trains (and before anything is written)
        if not args.dry_run:
            write_file(stored, json.dumps(settings, indent=2))
        import torch

        from largebatch.commands.bench import machine

        known = {"command": f"largebatch study {name} " + " ".join(argv), "kind": name, "seeds": args.seeds,
                 "claims_only": getattr(args, "claims_only", None), "train_size": train_size,
                 "machine": machine(torch.device("cpu")), "split": "validation" if args.val_split else "test",
                 **layout.facts}
        meta: dict = {}
        for key in kind.meta:
            meta.update(settings if key == "settings" else {key: known[key]})

        done: list[dict] = []                                                                     # step 4
        stop = None if args.dry_run else Stop()
        if stop is not None:
            stop.install()
        for i, ((group, lr, seed), run_dir) in enumerate(zip(cells, cell_dirs)):
            if stop is not None and stop.signum is not None:
                break
            done.append({**group.fields, "lr": lr, "seed": seed,
                         **run_cell(args, run_dir, group.sets(lr, seed), cell_label(group, lr, seed),
                                    f"{i + 1}/{len(cells)}", console, earlier, stop)})
            if not args.dry_run:
                write_outputs(args.out, kind, meta, done)
        body = tables(kind, meta, done)[1] if args.dry_run else write_outputs(args.out, kind, meta, done)
        if stop is not None and stop.signum is not None:
            return stopped(args.out, stop.signum, console, held)
        console.print(body)
        if args.dry_run:
            console.print(f"study: dry run, {len(done)} cells listed; nothing written to {args.out}")
            return 0
        diverged = sum(bool(c.get("diverged")) for c in done)
        console.print(f"study: {sum(c['top1'] is not None for c in done)}/{len(done)} cells done"
                      f"{f', {diverged} diverged' if diverged else ''} in {machine_time(done)} of training; results in "
                      f"{args.out / 'study.md'}, {args.out / 'study.json'}, {args.out / 'study.png'}")
        return 0
    finally:   # an error or a stop after --out was taken releases it too (the flock of this process)
        stop_cells()
        if held is not None:
            held.release()


def batch_scaling(argv: list[str]) -> int:
    return run("batch-scaling", argv)


def batch_control(argv: list[str]) -> int:
    return run("batch-control", argv)


def ensemble(argv: list[str]) -> int:
    return run("ensemble", argv)
