"""`largebatch plan`: predict what a training run costs: time to train, images/s, efficiency, where the time goes.

    largebatch plan RECIPE --devices N [--devices-per-node G] [--device h100] [flags]   a recipe's run
    largebatch plan --model resnet50 --device v100 --devices 2176 --devices-per-node 4 \\
        --intra-node nvlink2 --inter-node ib-edr:2 --algorithm torus2d --global-batch 34816 \\
        --epochs 90 --train-size 1281167 --precision fp16 [--price-per-device-hour X] [--json]
    largebatch plan ... --sweep devices=8:4096 [--out DIR]   table + PNGs, per-device batch fixed
    largebatch plan --validate                               the published-runs table
    largebatch plan --calibrate [--catalog-out F]            measure this machine (its GPU where it has one)

A recipe gives the model, image size, global batch and its phases, epochs, precision, comm algorithm and grid;
a flag of the same name overrides it (the flags are the recipe's keys: --global-batch is batch.global_batch,
--grid 4x2 is comm.grid). Without --stack the software stack is the default one for the device (largebatch's
own step where it was measured, else the newest MLPerf release with a figure for the device); the output names it.
"""
from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

from largebatch.cli import ArgumentParser
from largebatch.errors import UserError
from largebatch.perf.model import ALGORITHMS, Prediction, predict

# The values a recipe gives, by flag: (recipe key, built-in default without a recipe). One list: the parser's
# flags, the recipe reader and the flag/recipe merge all read it.
FROM_RECIPE: dict[str, tuple[str, Any]] = {
    "model": ("model.name", "resnet50"),
    "stem": ("model.stem", "imagenet"),
    "width": ("model.width", 64),
    "image_size": ("data.image_size", 224),
    "in_channels": ("data (1 for fashion_mnist/idx, else 3)", 3),
    "num_classes": ("data.num_classes (synthetic; fashion_mnist/idx: 10)", 1000),
    "train_size": ("data.train_size (or data.subset)", 1281167),
    "global_batch": ("batch.global_batch", 2048),
    "batch_phases": ("batch.phases", None),
    "resolution_phases": ("data.resolution_phases", None),
    "epochs": ("schedule.epochs + ensemble.cycles x ensemble.cycle_epochs (or its segments' epochs)", 90.0),
    "precision": ("train.precision", "fp16"),
    "algorithm": ("comm.algorithm", "native"),
    "grid": ("comm.grid", None),
    "inter": ("comm.inter", "halving_doubling"),
    "bucket_mb": ("comm.bucket_mb", 25.0),
    "eval_every": ("train.eval_every", 4.0),
    "optimizer": ("optim.name (its state in the memory per device)", "sgd"),
}


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="largebatch plan", description=__doc__.split("\n")[0])
    a = p.add_argument
    from largebatch.models import MODELS

    a("recipe", nargs="?", default=None,
      help="a recipe (name or YAML path): its model, data size, batch (and phases), epochs, precision and comm; "
           "flags override it")
    a("--model", default=None, help=f"model.name: one of {', '.join(MODELS)} (its FLOPs and gradient size; "
                                     "default resnet50)")
    a("--image-size", type=int, default=None, help="data.image_size: training image side in pixels (default 224)")
    a("--in-channels", type=int, default=None, help="input channels (default 3)")
    a("--num-classes", type=int, default=None, help="classes of the classifier head (default 1000)")
    a("--stem", default=None, help="model.stem: imagenet (7x7/2 + max-pool) or small (3x3/1); default imagenet")
    a("--width", type=int, default=None, help="model.width: channels of the first stage (default 64)")
    a("--device", default="v100", help="catalog device (see --list)")
    a("--devices", type=int, default=8, help="accelerators in the run")
    a("--devices-per-node", type=int, default=8, help="accelerators per node")
    a("--intra-node", default=None, help="intra-node link (default: the device's)")
    a("--inter-node", default="ib-edr:1", help="inter-node link[:links per node]")
    a("--algorithm", default=None, help=f"comm.algorithm: one of {', '.join(ALGORITHMS)} (default native: the "
                                         "backend's own all-reduce as NCCL runs it, the faster of ring and tree)")
    a("--grid", default=None, help="comm.grid: the torus2d grid XxY, e.g. 4x2 (default: the cheapest)")
    a("--torus-x", type=int, default=None, help="torus2d row length X of the grid X x (devices / X)")
    a("--inter", default=None, help="comm.inter: hierarchical's cross-node all-reduce (default halving_doubling)")
    a("--global-batch", type=int, default=None, help="batch.global_batch: images per step across all devices "
                                                      "(default 2048; a recipe's batch.phases apply too)")
    a("--epochs", type=float, default=None, help="schedule.epochs: training epochs (default 90)")
    a("--train-size", "--dataset-size", dest="train_size", type=int, default=None,
      help="data.train_size: training images per epoch (default ImageNet-1k's 1,281,167)")
    a("--precision", default=None, help="train.precision: fp16, bf16 or fp32 (default fp16)")
    a("--optimizer", default=None, choices=("sgd", "lars", "lamb"),
      help="optim.name: its state counts in the memory per device (default sgd, with momentum)")
    a("--stack", default=None,
      help="software stack: its factor on the device's speed (see --list; default: largebatch's own where measured "
           "on the device at the precision, else the newest MLPerf release with a figure for the device)")
    a("--eval-every", type=float, default=None,
      help="train.eval_every: epochs between evaluation passes, counted in time-to-train (default 4, MLPerf's; "
           "0: once at the end, as in a recipe)")
    a("--eval-images", type=int, default=50000,
      help="images of one evaluation pass (ImageNet-1k validation: 50,000; 0 leaves evaluation out)")
    a("--data-images-per-s", type=float, default=None,
      help="images/s the input pipeline delivers per device (e.g. `largebatch bench data`'s); default: it keeps up")
    a("--bucket-mb", type=float, default=None, help="comm.bucket_mb: gradient bucket size in MB (default 25)")
    a("--no-overlap", action="store_true", help="communication after backward, not during")
    a("--price-per-device-hour", type=float, default=None, help="USD per device-hour, for the cost (default: no cost)")
    a("--purchase-price", type=float, default=None, help="USD per device (default: the catalog's)")
    a("--json", action="store_true", help="print one JSON object")
    a("--sweep", default=None, help="devices=LO:HI (powers of two times devices per node)")
    a("--out", default="runs/plan", help="where --sweep writes its PNGs")
    a("--validate", action="store_true", help="the model against published runs")
    a("--calibrate", action="store_true",
      help="measure this machine (its GPU when CUDA is available) into the user catalog, for the model given by "
           "--model/--stem/--width/--in-channels/--image-size/--num-classes/--precision (or a recipe's)")
    a("--catalog-out", default=None, help="with --calibrate: the file to write")
    a("--nproc", type=int, default=None, help="with --calibrate: worker processes (default 2 on CPU, 1 on a GPU)")
    a("--list", action="store_true", help="list devices, links, algorithms and stacks")
    return p


def recipe_values(recipe: str) -> dict[str, Any]:
    """The plan's values that `recipe` gives (keyed like FROM_RECIPE), read with `largebatch.config.load`, so a
    recipe that `train` refuses is refused here in the same words."""
    from largebatch import config
    from largebatch.schedule import ensemble_epochs

    cfg = config.load(recipe)
    d = cfg.data
    size = d.image_size
    stem = cfg.model.stem if cfg.model.stem != "auto" else ("small" if size <= 64 else "imagenet")
    out: dict[str, Any] = dict(model=cfg.model.name, stem=stem, width=cfg.model.width, image_size=size,
                               global_batch=cfg.batch.global_batch, precision=cfg.train.precision,
                               algorithm=cfg.comm.algorithm, bucket_mb=cfg.comm.bucket_mb,
                               eval_every=float(cfg.train.eval_every), optimizer=cfg.optim.name)
    ens = cfg.ensemble
    out["epochs"] = float(cfg.schedule.epochs + ensemble_epochs(ens))
    if d.dataset in ("fashion_mnist", "idx"):
        out.update(in_channels=1, num_classes=10, train_size=60000 - (d.val_split or 0))
    elif d.dataset == "synthetic":
        out.update(num_classes=d.num_classes, train_size=d.synthetic_size)
    if d.train_size is not None:
        out["train_size"] = d.train_size - (d.val_split or 0)
    if d.subset is not None:
        out["train_size"] = d.subset
    if cfg.batch.phases:
        out["batch_phases"] = [(float(ph.start_epoch), ph.global_batch) for ph in cfg.batch.phases]
    if d.resolution_phases:
        out["resolution_phases"] = [(float(ph.start_epoch), ph.image_size) for ph in d.resolution_phases]
    if cfg.comm.grid is not None:
        out["grid"] = cfg.comm.grid
    if cfg.comm.inter is not None:
        out["inter"] = cfg.comm.inter
    return out


def resolve(args) -> dict[str, Any]:
    """The plan's values: a flag where given, else the recipe's, else the built-in default (FROM_RECIPE)."""
    from_recipe = recipe_values(args.recipe) if args.recipe else {}
    out = {}
    for key, (_, default) in FROM_RECIPE.items():
        flag = getattr(args, key, None)
        out[key] = flag if flag is not None else from_recipe.get(key, default)
    if args.global_batch is not None and from_recipe.get("batch_phases"):
        out["batch_phases"] = None          # --global-batch names the whole run's batch
    if args.image_size is not None and from_recipe.get("resolution_phases"):
        out["resolution_phases"] = None
    return out


def _kwargs(args, v: dict[str, Any]) -> dict:
    """predict()'s arguments from the parsed flags and the resolved values."""
    torus_x = args.torus_x
    if v["grid"] is not None:
        from largebatch.comm.topology import parse_grid

        x, y = parse_grid(v["grid"], "--grid")
        if x * y != args.devices and not args.sweep:
            raise UserError(f"the grid {v['grid']} (comm.grid / --grid) has {x * y} positions but --devices is "
                            f"{args.devices}; give a grid XxY with X*Y = {args.devices}.")
        torus_x = x
    eval_every = v["eval_every"]
    return dict(model=v["model"], device=args.device, devices=args.devices, devices_per_node=args.devices_per_node,
                intra_node=args.intra_node, inter_node=args.inter_node, algorithm=v["algorithm"],
                global_batch=v["global_batch"], epochs=v["epochs"], dataset_size=v["train_size"],
                precision=v["precision"], image_size=v["image_size"], in_channels=v["in_channels"],
                num_classes=v["num_classes"], stem=v["stem"], width=v["width"], bucket_mb=v["bucket_mb"],
                overlap_comm=not args.no_overlap, torus_x=torus_x,
                price_per_device_hour=args.price_per_device_hour, purchase_price=args.purchase_price,
                eval_every=eval_every if eval_every > 0 else v["epochs"],   # 0: once, at the end (as train does)
                eval_images=args.eval_images, stack=args.stack, batch_phases=v["batch_phases"],
                resolution_phases=v["resolution_phases"], data_images_per_s=args.data_images_per_s,
                inter=v["inter"])


def run_config(args, v: dict[str, Any]):
    """The run that `largebatch plan` prices, as a Config: the recipe's (or the defaults') with the plan's values
    (a flag where given). Its batch phases and micro-batch setting are the run's; the ensemble's epochs are in
    `epochs` already, and its lr (warm-up included) does not change how a batch splits."""
    from largebatch import config

    cfg = config.load(args.recipe) if args.recipe else config.Config()
    cfg.model.name, cfg.model.width, cfg.model.stem = v["model"], v["width"], v["stem"]
    cfg.data.image_size = v["image_size"]
    cfg.data.resolution_phases = [config.ResolutionPhase(start_epoch=float(a), image_size=int(size))
                                  for a, size in v["resolution_phases"] or []]
    cfg.train.precision, cfg.optim.name = v["precision"], v["optimizer"]
    cfg.batch.global_batch = v["global_batch"]
    cfg.batch.phases = [config.BatchPhase(start_epoch=int(a), global_batch=int(gb)) for a, gb in v["batch_phases"] or []]
    cfg.schedule.epochs, cfg.schedule.warmup_epochs = v["epochs"], 0
    cfg.ensemble.cycles, cfg.ensemble.segments = 0, []
    return cfg


def _memory(args, v: dict[str, Any], kw: dict) -> dict:
    """Memory per device from the catalog (`memory_gb`, with its source) and the run plan of largebatch/runplan.py
    for this run on `--devices` of them (the one the trainer and `train --dry-run` make): each batch's split into
    micro-batches, or one sentence when not even the model's state fits. Devices without a memory figure (the
    CPUs) are not checked."""
    import torch

    from largebatch import runplan
    from largebatch.data.info import DatasetInfo
    from largebatch.models import build_model
    from largebatch.perf.catalog import load_catalog

    entry = load_catalog()["devices"].get(args.device, {})
    if "memory_gb" not in entry:
        return {}
    try:   # shapes torch cannot describe: too large for any device (the estimate would only say it cannot run)
        with torch.device("meta"):
            build_model(v["model"], num_classes=v["num_classes"], in_channels=v["in_channels"], stem=v["stem"],
                        width=v["width"])
    except (RuntimeError, ValueError):
        raise UserError(f"model {v['model']} at width {v['width']} does not fit in memory (its shapes overflow); "
                        "give a smaller --width.") from None
    source = f"{entry.get('name', args.device)}: {entry.get('memory_gb_source', 'the catalog')}"
    info = DatasetInfo(v["num_classes"], v["in_channels"], v["image_size"], (0.5,) * v["in_channels"],
                       (0.25,) * v["in_channels"], 0, 0, "plan")
    plan = runplan.decide(run_config(args, v), info, world_size=args.devices, local_workers=args.devices_per_node,
                          train_size=v["train_size"], device_type="cuda",
                          device_memory=(int(float(entry["memory_gb"]) * 1e9), source))
    splits = {p.per_worker_batch: (p.micro_batch, p.accumulation) for p in plan.schedule.phases}
    note = plan.estimate.describe(plan.largest_micro_batch) if plan.estimate is not None else ""
    return {"splits": splits, "memory_note": note}


def _hms(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def _show(p: Prediction, recipe: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (f"{p.model} on {p.devices} x {p.device} ({p.nodes} nodes of {p.devices_per_node}), {p.algorithm}, "
             f"{p.precision}" + (f", recipe {recipe}" if recipe else ""))
    t = Table(title=title, show_header=False)
    ttt = p.time_to_train_s
    how = "default: " + p.stack_reason if p.stack_reason != "given" else "given by --stack"
    rows = [("time to train", f"{_hms(ttt)} ({p.epochs:g} epochs of {p.steps_per_epoch} steps at global batch "
                              f"{p.global_batch})"),
            ("images/s", f"{p.images_per_s:,.0f} ({p.images_per_s_per_device:,.1f} per device, MFU {100 * p.mfu:.1f}%)"),
            ("efficiency", f"{100 * p.scaling_efficiency:.1f}% of one device's speed, "
                           f"{100 * p.scaling_efficiency_node:.1f}% of one node's"),
            ("  compute", f"{_hms(p.compute_total_s)} ({_pct(p.compute_total_s, ttt)})"),
            ("  exposed communication", f"{_hms(p.exposed_comm_total_s)} ({_pct(p.exposed_comm_total_s, ttt)})"),
            ("  evaluation", f"{_hms(p.eval_time_s)} ({_pct(p.eval_time_s, ttt)})"),
            ("  data", f"{_hms(p.data_total_s)} ({_pct(p.data_total_s, ttt)})"
                       + ("" if p.data_total_s else " (the loader keeps up; --data-images-per-s to model one)")),
            ("step", f"{p.step_time_s * 1e3:.2f} ms: compute {p.compute_time_s * 1e3:.2f} ms, communication "
                     f"{p.comm_time_s * 1e3:.2f} ms of which {p.exposed_comm_s * 1e3:.2f} ms exposed"
                     + (f", data wait {p.data_time_s * 1e3:.2f} ms" if p.data_time_s else "")),
            ("per-device batch", f"{p.per_device_batch} (global {p.global_batch}, {p.image_size} px)"
                                 + (f" as {p.accumulation} micro-batches of {p.micro_batch} that fit the device "
                                    "(batch.micro_batch auto)" if p.accumulation > 1 else "")),
            *([("memory per device", p.memory)] if p.memory else []),
            ("gradient", f"{p.gradient_bytes / 2**20:.1f} MiB in {p.buckets} buckets"),
            ("device-hours", f"{p.device_hours:,.1f}"),
            ("stack", f"{p.stack} ({how}); another with --stack NAME (largebatch plan --list)")]
    for ph in p.phases:
        rows.append((f"phase epochs {ph['start_epoch']:g}-{ph['end_epoch']:g}",
                     f"global batch {ph['global_batch']}, {ph['image_size']} px: {_hms(ph['time_s'])}, "
                     f"{ph['images_per_s']:,.0f} images/s"))
    if p.torus_grid:
        rows.append(("torus grid", f"{p.torus_grid[0]}x{p.torus_grid[1]}"))
    if p.cost_usd is not None:
        rows.append(("cost", f"{p.cost_usd:,.0f} USD"))
    if p.hardware_usd is not None:
        rows.append(("hardware", f"{p.hardware_usd:,.0f} USD"))
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
    for note in p.notes:
        print(f"note: {note}")


def _sweep(args, kw: dict[str, Any]) -> int:
    key, _, rng = args.sweep.partition("=")
    lo_hi = rng.split(":")
    if key != "devices" or len(lo_hi) != 2 or not all(x.isdigit() for x in lo_hi):
        raise UserError(f"--sweep {args.sweep!r} is not understood; use devices=LO:HI, e.g. devices=8:4096.")
    lo, hi = int(lo_hi[0]), int(lo_hi[1])
    if lo < 1 or hi < lo:
        raise UserError(f"--sweep range {lo}:{hi} is empty; use 1 <= LO <= HI.")
    if kw["global_batch"] % args.devices:
        raise UserError(f"global batch {kw['global_batch']} does not split evenly over {args.devices} devices.")
    per_device = kw["global_batch"] // args.devices
    counts = sorted({2**k for k in range(int(math.log2(lo)), int(math.log2(hi)) + 1) if lo <= 2**k <= hi}
                    | {lo, hi})
    counts = [n for n in counts if n <= args.devices_per_node or n % args.devices_per_node == 0]
    if not counts:
        raise UserError(f"--sweep {args.sweep} holds no device count that fills whole nodes of "
                        f"{args.devices_per_node}; widen the range or change --devices-per-node.")
    results: dict[str, list[Prediction]] = {}
    for alg in ALGORITHMS:
        results[alg] = [predict(**{**kw, "algorithm": alg, "devices": n, "global_batch": per_device * n,
                                   "torus_x": None, "batch_phases": None}) for n in counts]
    from rich.console import Console
    from rich.table import Table

    stack = results[ALGORITHMS[0]][0].stack
    t = Table(title=f"{kw['model']} on {args.device}, {per_device} per device, {args.devices_per_node} per node, "
                    f"{args.inter_node}, stack {stack}")
    for col in ("devices", "algorithm", "step ms", "exposed ms", "images/s", "eff vs 1", "eff vs node",
                "time-to-train", "cost USD"):
        t.add_column(col, justify="right")
    for i, n in enumerate(counts):
        for alg in ALGORITHMS:
            p = results[alg][i]
            t.add_row(str(n), alg, f"{p.step_time_s * 1e3:.1f}", f"{p.exposed_comm_s * 1e3:.1f}",
                      f"{p.images_per_s:,.0f}", f"{100 * p.scaling_efficiency:.1f}%",
                      f"{100 * p.scaling_efficiency_node:.1f}%", _hms(p.time_to_train_s),
                      "-" if p.cost_usd is None else f"{p.cost_usd:,.0f}")
    Console(width=max(120, Console().width)).print(t)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    money = "cost_usd" if args.price_per_device_hour is not None else "device_hours"
    figs = [("scaling_efficiency.png", "scaling efficiency (vs one device)", lambda p: p.scaling_efficiency, True),
            ("time_to_train.png", "time-to-train (h)", lambda p: p.time_to_train_s / 3600, True),
            ("cost_vs_time.png", "cost (USD)" if money == "cost_usd" else "device-hours", lambda p: getattr(p, money),
             False)]
    for name, ylabel, fn, by_devices in figs:
        fig, ax = plt.subplots(figsize=(6, 4))
        for alg in ALGORITHMS:
            ps = results[alg]
            if by_devices:
                ax.plot(counts, [fn(p) for p in ps], marker="o", label=alg)
            else:
                ax.plot([p.time_to_train_s / 3600 for p in ps], [fn(p) for p in ps], marker="o", label=alg)
        ax.set_xscale("log")
        ax.set_xlabel("devices" if by_devices else "time-to-train (h)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        from largebatch.checkpoint import atomic_write

        buf = io.BytesIO()
        fig.savefig(buf, format=Path(name).suffix[1:] or "png", dpi=100)
        plt.close(fig)
        atomic_write(out / name, buf.getvalue())   # whole or absent
    print(f"wrote {', '.join(str(out / f[0]) for f in figs)}")
    return 0


def _validate(args, v: dict[str, Any]) -> None:
    """Every number a user gives is checked here, one sentence each (a negative price gave a negative cost)."""
    from largebatch.models import check_model_name

    check_model_name(v["model"], "--model")
    for flag, value, low in (("--image-size", v["image_size"], 1), ("--in-channels", v["in_channels"], 1),
                             ("--num-classes", v["num_classes"], 2), ("--width", v["width"], 1),
                             ("--devices", args.devices, 1), ("--devices-per-node", args.devices_per_node, 1),
                             ("--global-batch", v["global_batch"], 1), ("--train-size", v["train_size"], 1),
                             ("--nproc", 1 if args.nproc is None else args.nproc, 1),
                             ("--eval-images", args.eval_images, 0)):
        if value < low:
            raise UserError(f"{flag} is {value}; give {low} or more.")
    for flag, value, zero_ok in (("--epochs", v["epochs"], False), ("--bucket-mb", v["bucket_mb"], False),
                                 ("--eval-every", v["eval_every"], True),
                                 ("--data-images-per-s", args.data_images_per_s, False),
                                 ("--price-per-device-hour", args.price_per_device_hour, True),
                                 ("--purchase-price", args.purchase_price, True)):
        if value is not None and (not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok)):
            raise UserError(f"{flag} is {value}; give a {'non-negative' if zero_ok else 'positive'} finite number.")
    if args.torus_x is not None and args.torus_x < 1:
        raise UserError(f"--torus-x is {args.torus_x}; give a divisor of --devices.")
    if args.torus_x is not None and args.grid is not None:
        raise UserError(f"--torus-x {args.torus_x} and --grid {args.grid} both give the torus2d grid; keep one "
                        "(--grid XxY, as comm.grid).")
    grid = args.torus_x if args.torus_x is not None else v["grid"]
    gflag = f"--torus-x {args.torus_x}" if args.torus_x is not None else f"the grid {v['grid']}"
    if grid is not None and v["algorithm"] != "torus2d" and not args.sweep:
        raise UserError(f"{gflag} is the torus2d row length, but --algorithm is {v['algorithm']}; "
                        "add --algorithm torus2d or drop it." if args.torus_x is not None else
                        f"{gflag} (comm.grid / --grid) is a torus2d grid, but the algorithm is {v['algorithm']}; "
                        "add --algorithm torus2d or drop the grid.")
    if grid is not None and args.sweep:
        raise UserError(f"{gflag} does not apply to --sweep, which picks the cheapest row length "
                        f"for each device count; drop {'--torus-x' if args.torus_x is not None else 'the grid'}.")
    if v["algorithm"] not in ALGORITHMS:
        raise UserError(f"unknown algorithm {v['algorithm']!r}; choose one of: {', '.join(ALGORITHMS)}"
                        + (" (noop has no communication to plan)." if v["algorithm"] == "noop" else "."))


def _list() -> int:
    from largebatch.perf.catalog import load_catalog, stack_factor, stack_names

    cat = load_catalog()
    print("devices:    " + ", ".join(sorted(cat["devices"])))
    print("links:      " + ", ".join(sorted(cat["links"])))
    print("algorithms: " + ", ".join(ALGORITHMS))

    def described(name: str) -> str:
        entry = cat["stacks"][name]
        own = entry.get("devices") or {}
        extra = ""
        for d in sorted(own):
            precs = sorted(own[d].get("precisions") or {})
            extra += "".join(f", {d} {p} x{stack_factor(name, d, p):.2f}" for p in precs) if precs else \
                f", {d} x{stack_factor(name, d):.2f}"
        return f"{name} [{entry.get('released', '?')}] (x{stack_factor(name):.2f}{extra})"
    print("stacks:     " + ", ".join(described(n) for n in stack_names()))
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    v = resolve(args)
    _validate(args, v)
    if args.list:
        return _list()
    if args.calibrate:
        from largebatch.cli import check_output_path
        from largebatch.perf import calibrate
        from largebatch.perf.catalog import read_user_catalog, user_catalog_path

        out = Path(args.catalog_out) if args.catalog_out else user_catalog_path()
        check_output_path("--catalog-out", out)   # before measuring: a bad path or file must not cost the run
        read_user_catalog(out)
        entries = calibrate.measure(v["model"], v["image_size"], v["in_channels"], v["num_classes"], v["stem"],
                                    v["width"], v["precision"], args.nproc)
        path = calibrate.write(entries, out)
        print(json.dumps(entries, indent=2) if args.json else
              f"wrote {', '.join(k for sec in entries.values() for k in sec)} to {path}")
        return 0
    if args.validate:
        from largebatch.perf import validate
        rs = validate.rows()
        if args.json:
            print(json.dumps([{**r.__dict__, "error": r.error} for r in rs], indent=2))
        else:
            validate.table(rs)
            ok, n = validate.summary(rs)
            print(f"\n{ok} of {n} validation rows within 25% of the published figure.")
        return 0
    kw = _kwargs(args, v)
    if args.sweep:
        return _sweep(args, kw)
    predict(**kw)   # its own checks first (flags, a gradient too large for its buckets)
    kw.update(_memory(args, v, kw))
    p = predict(**kw)
    if args.json:
        result = p.to_json()
        if args.recipe:
            result["recipe"] = args.recipe
        print(json.dumps(result, indent=2))
    else:
        _show(p, args.recipe)
    return 0
