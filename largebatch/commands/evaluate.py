"""`largebatch evaluate RUN_DIR [--ensemble] [--swa] [--checkpoint PATH] [--out FILE] [--nproc-per-node N]`

Re-evaluates a finished run, distributed like training (each rank a contiguous shard of the
test set, every image exactly once):

1. Read RUN_DIR/config.yaml (the resolved config of the run) and build its data and model (any model.name:
   largebatch's, timm:, torchvision: or a factory; a checkpoint that recorded another model is refused).
2. Without --ensemble: load the newest intact checkpoint (or --checkpoint) and report top-1/top-5/loss.
3. With --ensemble: load every snapshot in RUN_DIR/snapshots, report each one and the average of
   their softmax outputs (largebatch.ensemble); --swa adds the BN-recomputed weight average.
4. Rank 0 prints a table and one JSON line and writes RUN_DIR/evaluation.json (or --out FILE), a path checked
   before any work: a read-only run directory is said at once, not after the evaluation.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from largebatch.cli import ArgumentParser
from largebatch.errors import UserError


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="largebatch evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="run directory written by largebatch train")
    p.add_argument("--ensemble", action="store_true", help="evaluate every snapshot and their softmax average")
    p.add_argument("--swa", action="store_true", help="with --ensemble: also the weight average (BN recomputed)")
    p.add_argument("--checkpoint", type=Path, default=None, help="evaluate this checkpoint file instead of the newest")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="start N local workers through torchrun (1: evaluate in this process)")
    p.add_argument("--batch", type=int, default=512, help="evaluation images per forward pass per worker")
    p.add_argument("--out", type=Path, default=None,
                   help="where the result goes (default RUN_DIR/evaluation.json; e.g. for a read-only run directory)")
    return p


def _launch(args, argv: list[str]) -> int:
    from largebatch.launch import check_worker_count, local_workers, run_agent, without_options

    check_worker_count("--nproc-per-node", args.nproc_per_node)
    launcher = local_workers(args.nproc_per_node, ["evaluate", *without_options(argv, "--nproc-per-node")])
    return run_agent(launcher)[0]


def load_run_config(run_dir: Path):
    """Step 1: the config a run was trained with."""
    from largebatch import config as config_mod

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise UserError(f"{path} does not exist; give the run directory of a largebatch train run.")
    data = config_mod.load_yaml(path, what="run config")
    return config_mod.from_dict(data, recipe=str(data.get("recipe", "custom")), saved=True)


def run(run_dir: Path, *, use_ensemble: bool, swa: bool = False, checkpoint_path: Path | None = None,
        batch: int = 512) -> dict:
    """Steps 1-3 in the current (possibly torchrun) process; every rank returns the same result."""
    import torch

    from largebatch import checkpoint, dist as dist_mod, ensemble
    from largebatch.data import build_data
    from largebatch.data.info import check_classes
    from largebatch.placement import use_channels_last
    from largebatch.evaluation import evaluate
    from largebatch.models.classifier import build_classifier

    cfg = load_run_config(run_dir)
    device = dist_mod.pick_device(cfg.train.device)
    info = dist_mod.init(device, cfg.comm.timeout_s)
    dist_mod.set_threads(cfg.train.threads, info.local_world_size)
    train, test, data_info = build_data(cfg.data, cfg.train.seed)
    check_classes(run_dir, data_info.classes, write=False)   # the labels the run was trained with
    torch.manual_seed(cfg.train.seed)
    model = build_classifier(cfg.model, data_info, device,
                             use_channels_last(cfg.train.channels_last, device, cfg.train.precision),
                             [p.image_size for p in cfg.data.resolution_phases])
    channels_last = model.channels_last
    out: dict = {"run_dir": str(run_dir), "world_size": info.world_size, "model": model.built}
    if use_ensemble:
        rec, _ = ensemble.evaluate_run(model, run_dir, train, test, info, device, batch=batch, bn_batch=batch,
                                       seed=cfg.train.seed, precision=cfg.train.precision,
                                       channels_last=channels_last, swa=swa, flip=cfg.train.eval_flip)
        out.update(rec)
    else:
        if checkpoint_path is None:
            found = checkpoint.latest(run_dir / "checkpoints")
            if found is None:
                raise UserError(f"no intact checkpoint in {run_dir / 'checkpoints'}; train the run first "
                                "or give --checkpoint.")
            checkpoint_path = found[0]
        elif not checkpoint_path.is_file():
            what = "is a directory" if checkpoint_path.is_dir() else "does not exist"
            raise UserError(f"--checkpoint {checkpoint_path} {what}; give a step-*.pt file.")
        meta_path = checkpoint_path.with_suffix(".json")
        if meta_path.is_file() and checkpoint.verify(meta_path) is None:
            raise UserError(f"--checkpoint {checkpoint_path} is damaged: it does not match the size and checksum "
                            f"{meta_path.name} records; give another of the run's checkpoints, or restore this one.")
        try:
            state = checkpoint.load(checkpoint_path)["model"]
        except Exception as err:   # not a torch checkpoint, or not one of largebatch's
            raise UserError(f"--checkpoint {checkpoint_path} is not a largebatch checkpoint "
                            f"({type(err).__name__}); give a step-*.pt file from the run's checkpoints/.") from None
        if not meta_path.is_file():
            raise UserError(f"--checkpoint {checkpoint_path} has no {meta_path.name} beside it, so it cannot be "
                            "checked for damage; copy it with its .json file from the run's checkpoints/.")
        bad = checkpoint.non_finite(state)
        if bad is not None:
            raise UserError(f"--checkpoint {checkpoint_path} holds non-finite weights ({bad}: written as its run "
                            "diverged); give an earlier checkpoint of the run.")
        was = (checkpoint.verify(checkpoint_path.with_suffix(".json")) or {}).get("model")   # what the run built
        if isinstance(was, dict) and was.get("identity") != model.built.get("identity"):
            raise UserError(f"checkpoint {checkpoint_path} was written by model {was.get('name')} "
                            f"({was.get('identity')}; {was.get('source')}) but the run's config builds "
                            f"{model.built['identity']} ({model.built['source']}); give a checkpoint written by the "
                            f"run in {run_dir}, or, if it is the run's own, install the library the run was trained "
                            "with.")
        checkpoint.restore(model, state, "run's model", checkpoint_path,
                           f"give a checkpoint written by the run in {run_dir}.")
        res = evaluate(model, test, info, device, precision=cfg.train.precision, channels_last=channels_last,
                       flip=cfg.train.eval_flip, batch=batch)
        out.update({"checkpoint": str(checkpoint_path), **res})
    dist_mod.shutdown(barrier=True)
    return out


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"largebatch evaluate {result['run_dir']}")
    for col in ("model", "step", "epoch", "top-1", "top-5", "loss"):
        table.add_column(col)
    for s in result.get("snapshots", []):
        table.add_row("snapshot", str(s["step"]), f"{s['epoch']:.4g}", f"{s['top1']:.4f}", f"{s['top5']:.4f}",
                      f"{s['loss']:.4f}")
    if "ensemble_top1" in result:
        table.add_row("ensemble (softmax average)", "", "", f"{result['ensemble_top1']:.4f}",
                      f"{result['ensemble_top5']:.4f}", f"{result['ensemble_loss']:.4f}")
    if "swa_top1" in result:
        table.add_row("weight average (BN recomputed)", "", "", f"{result['swa_top1']:.4f}",
                      f"{result['swa_top5']:.4f}", f"{result['swa_loss']:.4f}")
    if "top1" in result:
        table.add_row(Path(result["checkpoint"]).name, "", "", f"{result['top1']:.4f}", f"{result['top5']:.4f}",
                      f"{result['loss']:.4f}")
    Console(stderr=True).print(table)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.swa and not args.ensemble:
        raise UserError("--swa averages the snapshots' weights; give it together with --ensemble.")
    if args.batch < 1:
        raise UserError(f"--batch is {args.batch}; give 1 or more images.")
    if not args.run_dir.is_dir():
        what = "is a file, not a directory" if args.run_dir.exists() else "does not exist"
        raise UserError(f"run directory {args.run_dir} {what}; give the --run-dir of a training run.")
    out = args.out or args.run_dir / "evaluation.json"
    from largebatch.cli import check_output_path

    if args.out is None and not os.access(args.run_dir, os.W_OK):   # before any work, not after the evaluation
        raise UserError(f"run directory {args.run_dir} is not writable (a read-only file system or its permissions), "
                        f"so the result cannot go to {out}; give --out FILE to write it elsewhere.")
    check_output_path("--out", out)
    if args.nproc_per_node not in (None, 1) and "LOCAL_RANK" not in os.environ:
        return _launch(args, argv)   # one worker evaluates in this process, as without --nproc-per-node
    result = run(args.run_dir, use_ensemble=args.ensemble, swa=args.swa, checkpoint_path=args.checkpoint,
                 batch=args.batch)
    if os.environ.get("RANK", "0") == "0":
        _print(result)
        from largebatch.rundir import write_own

        out.parent.mkdir(parents=True, exist_ok=True)
        write_own(out, json.dumps(result, indent=2).encode())   # whole or absent
        print(json.dumps(result), file=sys.stdout, flush=True)
    return 0
