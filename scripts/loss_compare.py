"""Golden per-step losses: a refactor that must not change numbers proves it against recorded losses (as
torchtitan's tests/assets/losses and loss_compare.py --assert-equal do).

    python scripts/loss_compare.py                  # run the golden runs, print their per-step losses
    python scripts/loss_compare.py --assert-equal   # compare with tests/assets/losses/; exit 1 on any change
    python scripts/loss_compare.py --update         # rewrite this machine class's files (numbers changed on purpose)

1. The runs (`GOLDEN`): tiny deterministic trainings on the synthetic source, one process, one thread, fp32:
   SGD, LARS and LAMB, each 12 steps at a global batch of 32 in two micro-batches of 16, warm-up over the
   first epoch (8 steps: the lr changes every step, so the momentum correction acts), label smoothing 0.1,
   an EMA, the final evaluation.
2. Their record: every step's training loss and the final evaluation's loss and top-1, as Python's repr of
   the float (exact), one file per run and machine class.
3. The machine class: CPU kernels sum in other orders by vendor and instruction set (oneDNN and MKL pick
   their kernels by both: an AVX-512 Xeon and an AVX-512 EPYC differ in the last bit), so losses are
   recorded per class, `<vendor>-<isa>` (`amd-avx512`, `intel-avx512-amx`, `intel-avx2`, ...), with the
   torch version. On a class with a file the comparison is exact; a class without one compares with another
   class's file within `CROSS_CLASS_RTOL` and says so. Kernel order moves these losses by about 1e-7
   (one float32 ulp; at most 2.1e-7 relative between the recorded classes amd-avx2, amd-avx512 and
   intel-avx512-amx, torch 2.13.0); the tolerance is about 50 times that, so a change of the step's numbers
   smaller than 1e-5 is caught only on a recorded class.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "tests" / "assets" / "losses"
CROSS_CLASS_RTOL = 1e-5
COMMON = ["model.width=4", "data.dataset=synthetic", "data.synthetic_size=256", "data.image_size=16",
          "batch.global_batch=32", "batch.micro_batch=16", "train.log_every=1", "train.max_steps=12",
          "train.threads=1", "train.plots=false", "train.eval_every=0", "schedule.warmup_epochs=1",
          "train.label_smoothing=0.1", "train.ema=0.9", "train.device=cpu", "train.precision=fp32"]
GOLDEN = {   # each pins its lr: a recipe's tuned lr is not the golden runs' business
    "sgd": ["optim.name=sgd", "optim.nesterov=true", "optim.lr=0.5"],
    "lars": ["optim.name=lars", "optim.trust_coefficient=0.02", "optim.lr=0.5"],
    "lamb": ["optim.name=lamb", "optim.lr=0.002"],
}


def machine_class() -> str:
    """Step 3."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]     # the first processor's fields
    except OSError:
        first = ""
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(field.get("vendor_id", ""), "cpu")
    words = set(field.get("flags", "").split())
    isa = ("avx512-amx" if "amx_tile" in words else "avx512") if "avx512f" in words else \
        "avx2" if "avx2" in words else "generic"
    return f"{vendor}-{isa}"


def run(name: str) -> dict:
    """Step 1-2 for one golden run: {'steps': [loss, ...], 'eval_loss': ..., 'eval_top1': ...}."""
    import torch

    from largebatch import config
    from largebatch.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix=f"largebatch-golden-{name}-") as tmp:
            cfg = config.load("fashion_mnist", [*COMMON, *GOLDEN[name]])
            Trainer(cfg, Path(tmp) / "run", quiet=True).fit()
            recs = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    finally:
        torch.set_num_threads(threads)
    steps = [r["loss"] for r in recs if r.get("kind") == "train"]
    final = [r for r in recs if r.get("kind") == "eval"][-1]
    return {"steps": steps, "eval_loss": final["loss"], "eval_top1": final["top1"]}


def path_for(name: str, cls: str) -> Path:
    return ASSETS / f"{name}.{cls}.json"


def write(name: str, record: dict, cls: str) -> Path:
    import torch

    path = path_for(name, cls)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run": name, "overrides": [*COMMON, *GOLDEN[name]], "machine_class": cls,
                                "torch": torch.__version__, **record}, indent=1) + "\n")
    return path


def compare(name: str, record: dict, cls: str) -> list[str]:
    """Step 3: the differences from the recorded file (empty: equal); exact on this class, else within
    CROSS_CLASS_RTOL of another class's record."""
    import torch

    path = path_for(name, cls)
    exact = path.is_file()
    if not exact:
        others = sorted(ASSETS.glob(f"{name}.*.json"))
        if not others:
            return [f"{name}: no recorded losses in {ASSETS}; run scripts/loss_compare.py --update"]
        path = others[0]
    want = json.loads(path.read_text())
    if want["torch"] != torch.__version__:
        exact = False
    got_values = [*record["steps"], record["eval_loss"], record["eval_top1"]]
    want_values = [*want["steps"], want["eval_loss"], want["eval_top1"]]
    labels = [f"step {i + 1} loss" for i in range(len(record["steps"]))] + ["eval loss", "eval top-1"]
    if len(got_values) != len(want_values):
        return [f"{name}: {len(record['steps'])} steps logged, {len(want['steps'])} recorded in {path.name}"]
    diffs = []
    for label, a, b in zip(labels, got_values, want_values):
        if (a != b) if exact else abs(a - b) > CROSS_CLASS_RTOL * max(abs(b), 1e-12):
            diffs.append(f"{name}: {label} is {a!r}, recorded {b!r} ({path.name}, "
                         f"{'exact' if exact else f'within {CROSS_CLASS_RTOL:g}'})")
    return diffs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--assert-equal", action="store_true", help="compare with the recorded losses; exit 1 on a change")
    p.add_argument("--update", action="store_true", help="rewrite this machine class's recorded losses")
    p.add_argument("--runs", default=",".join(GOLDEN), help="comma-separated golden runs")
    args = p.parse_args()
    cls = machine_class()
    failed = []
    for name in args.runs.split(","):
        record = run(name)
        print(f"{name} ({cls}): " + " ".join(f"{v:.6f}" for v in record["steps"])
              + f" | eval {record['eval_loss']:.6f} top-1 {record['eval_top1']:.4f}")
        if args.update:
            print(f"  wrote {write(name, record, cls)}")
        elif args.assert_equal:
            failed += compare(name, record, cls)
    for line in failed:
        print(line, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
