"""`largebatch plan`: predict step time, scaling efficiency, time-to-train and cost of a plan.

    largebatch plan --model resnet50 --device v100 --devices 2176 --devices-per-node 4 \\
        --intra-node nvlink2 --inter-node ib-edr:2 --algorithm torus2d --global-batch 34816 \\
        --epochs 90 --dataset-size 1281167 --precision fp16 [--price-per-device-hour X] [--json]
    largebatch plan ... --sweep devices=8:4096 [--out DIR]   table + PNGs, per-device batch fixed
    largebatch plan --validate                               the published-runs table
    largebatch plan --calibrate [--catalog-out F]            measure this machine
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from largebatch.cli import ArgumentParser
from largebatch.errors import UserError
from largebatch.perf.model import ALGORITHMS, Prediction, predict


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="largebatch plan", description=__doc__.split("\n")[0])
    a = p.add_argument
    from largebatch.models import MODELS

    a("--model", default="resnet50", help=f"architecture, one of {', '.join(MODELS)} (its FLOPs and gradient size)")
    a("--image-size", type=int, default=224, help="training image side in pixels")
    a("--in-channels", type=int, default=3, help="input channels")
    a("--num-classes", type=int, default=1000, help="classes of the classifier head")
    a("--stem", default="imagenet", help="imagenet (7x7/2 + max-pool) or small (3x3/1)")
    a("--width", type=int, default=64, help="channels of the first stage (64 for the standard ResNets)")
    a("--device", default="v100", help="catalog device (see --list)")
    a("--devices", type=int, default=8, help="accelerators in the run")
    a("--devices-per-node", type=int, default=8, help="accelerators per node")
    a("--intra-node", default=None, help="intra-node link (default: the device's)")
    a("--inter-node", default="ib-edr:1", help="inter-node link[:links per node]")
    a("--algorithm", default="native", help=f"one of {', '.join(ALGORITHMS)} (native: the backend's own "
                                             "all-reduce as NCCL runs it, the faster of ring and tree per message)")
    a("--torus-x", type=int, default=None, help="torus2d row length (default: the cheapest divisor)")
    a("--global-batch", type=int, default=2048, help="images per step across all devices")
    a("--epochs", type=float, default=90.0, help="training epochs")
    a("--dataset-size", type=int, default=1281167, help="training images per epoch (ImageNet-1k: 1,281,167)")
    a("--precision", default="fp16", help="training precision: the device's peak for it from the catalog")
    a("--stack", default="mlperf-2020",
      help="software stack: its factor on the device's speed (see --list; default: MLPerf v0.7-class, the catalog's)")
    a("--eval-every", type=float, default=4.0,
      help="epochs between evaluation passes, counted in time-to-train (MLPerf: 4; 0 leaves evaluation out)")
    a("--eval-images", type=int, default=50000, help="images of one evaluation pass (ImageNet-1k validation: 50,000)")
    a("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MB (tensor fusion)")
    a("--no-overlap", action="store_true", help="communication after backward, not during")
    a("--price-per-device-hour", type=float, default=None, help="USD per device-hour, for the cost (default: no cost)")
    a("--purchase-price", type=float, default=None, help="USD per device (default: the catalog's)")
    a("--json", action="store_true", help="print one JSON object")
    a("--sweep", default=None, help="devices=LO:HI (powers of two times devices per node)")
    a("--out", default="runs/plan", help="where --sweep writes its PNGs")
    a("--validate", action="store_true", help="the model against published runs")
    a("--calibrate", action="store_true",
      help="measure this machine into the user catalog, for the model given by --model/--stem/--width/"
           "--in-channels/--image-size/--num-classes/--precision (pass those of your training run)")
    a("--catalog-out", default=None, help="with --calibrate: the file to write")
    a("--nproc", type=int, default=2, help="with --calibrate: worker processes")
    a("--list", action="store_true", help="list devices, links and algorithms")
    return p


def _kwargs(args) -> dict:
    return dict(model=args.model, device=args.device, devices=args.devices, devices_per_node=args.devices_per_node,
                intra_node=args.intra_node, inter_node=args.inter_node, algorithm=args.algorithm,
                global_batch=args.global_batch, epochs=args.epochs, dataset_size=args.dataset_size,
                precision=args.precision, image_size=args.image_size, in_channels=args.in_channels,
                num_classes=args.num_classes, stem=args.stem, width=args.width, bucket_mb=args.bucket_mb,
                overlap_comm=not args.no_overlap, torus_x=args.torus_x,
                price_per_device_hour=args.price_per_device_hour, purchase_price=args.purchase_price,
                eval_every=args.eval_every, eval_images=args.eval_images, stack=args.stack)


def _hms(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _show(p: Prediction) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{p.model} on {p.devices} x {p.device} ({p.nodes} nodes of {p.devices_per_node}), "
                    f"{p.algorithm}, {p.precision}", show_header=False)
    rows = [("per-device batch", f"{p.per_device_batch} (global {p.global_batch})"),
            ("gradient", f"{p.gradient_bytes / 2**20:.1f} MiB in {p.buckets} buckets"),
            ("compute (fwd+bwd)", f"{p.compute_time_s * 1e3:.2f} ms"),
            ("communication", f"{p.comm_time_s * 1e3:.2f} ms, exposed {p.exposed_comm_s * 1e3:.2f} ms"),
            ("step", f"{p.step_time_s * 1e3:.2f} ms"),
            ("images/s", f"{p.images_per_s:,.0f} ({p.images_per_s_per_device:,.1f} per device, MFU {100 * p.mfu:.1f}%)"),
            ("scaling efficiency", f"{100 * p.scaling_efficiency:.1f}% vs one device, "
                                   f"{100 * p.scaling_efficiency_node:.1f}% vs one node"),
            ("time-to-train", f"{_hms(p.time_to_train_s)} ({p.epochs:g} epochs, {p.steps_per_epoch} steps each; "
                              f"evaluation {_hms(p.eval_time_s)} of it)"),
            ("device-hours", f"{p.device_hours:,.1f}")]
    if p.torus_grid:
        rows.append(("torus grid", f"{p.torus_grid[0]} x {p.torus_grid[1]}"))
    if p.cost_usd is not None:
        rows.append(("cost", f"{p.cost_usd:,.0f} USD"))
    if p.hardware_usd is not None:
        rows.append(("hardware", f"{p.hardware_usd:,.0f} USD"))
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
    for note in p.notes:
        print(f"note: {note}")


def _sweep(args) -> int:
    key, _, rng = args.sweep.partition("=")
    lo_hi = rng.split(":")
    if key != "devices" or len(lo_hi) != 2 or not all(x.isdigit() for x in lo_hi):
        raise UserError(f"--sweep {args.sweep!r} is not understood; use devices=LO:HI, e.g. devices=8:4096.")
    lo, hi = int(lo_hi[0]), int(lo_hi[1])
    if lo < 1 or hi < lo:
        raise UserError(f"--sweep range {lo}:{hi} is empty; use 1 <= LO <= HI.")
    if args.global_batch % args.devices:
        raise UserError(f"global batch {args.global_batch} does not split evenly over {args.devices} devices.")
    per_device = args.global_batch // args.devices
    counts = sorted({2**k for k in range(int(math.log2(lo)), int(math.log2(hi)) + 1) if lo <= 2**k <= hi}
                    | {lo, hi})
    counts = [n for n in counts if n <= args.devices_per_node or n % args.devices_per_node == 0]
    if not counts:
        raise UserError(f"--sweep {args.sweep} holds no device count that fills whole nodes of "
                        f"{args.devices_per_node}; widen the range or change --devices-per-node.")
    results: dict[str, list[Prediction]] = {}
    kw = _kwargs(args)
    for alg in ALGORITHMS:
        results[alg] = [predict(**{**kw, "algorithm": alg, "devices": n, "global_batch": per_device * n,
                                   "torus_x": None}) for n in counts]
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{args.model} on {args.device}, {per_device} per device, {args.devices_per_node} per node, "
                    f"{args.inter_node}")
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
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
    print(f"wrote {', '.join(str(out / f[0]) for f in figs)}")
    return 0


def _validate(args) -> None:
    """Every number a user gives is checked here, one sentence each (a negative price gave a negative cost)."""
    from largebatch.models import check_model_name

    check_model_name(args.model, "--model")
    for flag, value, low in (("--image-size", args.image_size, 1), ("--in-channels", args.in_channels, 1),
                             ("--num-classes", args.num_classes, 2), ("--width", args.width, 1),
                             ("--devices", args.devices, 1), ("--devices-per-node", args.devices_per_node, 1),
                             ("--global-batch", args.global_batch, 1), ("--dataset-size", args.dataset_size, 1),
                             ("--nproc", args.nproc, 1), ("--eval-images", args.eval_images, 0)):
        if value < low:
            raise UserError(f"{flag} is {value}; give {low} or more.")
    for flag, value, zero_ok in (("--epochs", args.epochs, False), ("--bucket-mb", args.bucket_mb, False),
                                 ("--eval-every", args.eval_every, True),
                                 ("--price-per-device-hour", args.price_per_device_hour, True),
                                 ("--purchase-price", args.purchase_price, True)):
        if value is not None and (not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok)):
            raise UserError(f"{flag} is {value}; give a {'non-negative' if zero_ok else 'positive'} finite number.")
    if args.torus_x is not None and args.torus_x < 1:
        raise UserError(f"--torus-x is {args.torus_x}; give a divisor of --devices.")
    if args.torus_x is not None and args.algorithm != "torus2d" and not args.sweep:
        raise UserError(f"--torus-x {args.torus_x} is the torus2d row length, but --algorithm is {args.algorithm}; "
                        "add --algorithm torus2d or drop --torus-x.")
    if args.torus_x is not None and args.sweep:
        raise UserError(f"--torus-x {args.torus_x} does not apply to --sweep, which picks the cheapest row length "
                        "for each device count; drop --torus-x.")


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    _validate(args)
    if args.list:
        from largebatch.perf.catalog import load_catalog
        cat = load_catalog()
        print("devices:    " + ", ".join(sorted(cat["devices"])))
        print("links:      " + ", ".join(sorted(cat["links"])))
        print("algorithms: " + ", ".join(ALGORITHMS))
        from largebatch.perf.catalog import load_catalog, stack_factor, stack_names

        def described(name: str) -> str:
            own = (load_catalog()["stacks"][name].get("devices") or {})
            extra = "".join(f", {d} x{stack_factor(name, d):.2f}" for d in sorted(own))
            return f"{name} (x{stack_factor(name):.2f}{extra})"
        print("stacks:     " + ", ".join(described(n) for n in stack_names()))
        return 0
    if args.calibrate:
        from largebatch.cli import check_output_path
        from largebatch.perf import calibrate
        from largebatch.perf.catalog import read_user_catalog, user_catalog_path

        out = Path(args.catalog_out) if args.catalog_out else user_catalog_path()
        check_output_path("--catalog-out", out)   # before measuring: a bad path or file must not cost the run
        read_user_catalog(out)
        entries = calibrate.measure(args.model, args.image_size, args.in_channels, args.num_classes, args.stem,
                                    args.width, args.precision, args.nproc)
        path = calibrate.write(entries, out)
        print(json.dumps(entries, indent=2) if args.json else f"wrote this-machine and loopback to {path}")
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
    if args.sweep:
        return _sweep(args)
    p = predict(**_kwargs(args))
    if args.json:
        print(json.dumps(p.to_json(), indent=2))
    else:
        _show(p)
    return 0
