"""Every ImageNet recipe end to end (recipes/imagenet_resnet50_*.yaml), as a user runs it: `largebatch train RECIPE`
on a miniature ILSVRC tree in Kaggle's layout (tests/imagenet_tree.py), a few steps through an evaluation and a
checkpoint, then `--resume` from that checkpoint to a later step.

The overrides are only what a CPU and a miniature force, derived from the recipe so that its shape stays:
data.root (the one thing a user sets), data.image_size 32 and model.width 8 (a ResNet-50 a CPU steps in ~50 ms),
the global batch(es) scaled down by one factor (batch.phases keep their epochs and ratio), train.max_steps,
data.loader_workers 0 and train.threads 1 (2 cores shared with other work: with a second intra-op thread, 4 steps
took 22 s instead of 0.3 s while another process held the other core). Everything else is the recipe's: model,
optimizer, scaling rule, warm-up, decay, phases, ensemble cycles, label smoothing, log/eval/checkpoint cadence and
train.precision fp16, which trains as bf16 on a CPU and says so in one line.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, user_error
from imagenet_tree import ilsvrc


RECIPES = ROOT / "recipes"
PER_CLASS = 5          # 3 classes x 5 + a PNG, a CMYK JPEG and a nested image: 18 training images
TRAIN_IMAGES = 3 * PER_CLASS + 3
VAL_PER_CLASS = 2      # 6 validation images in ImageNet's flat val/ with Kaggle's LOC_val_solution.csv
CPU_MINIATURE = ["data.image_size=32", "model.width=8", "data.loader_workers=0", "train.threads=1"]
FP16_LINE = ("largebatch: train.precision fp16 needs CUDA; training in bf16 on CPU "
             "(set train.precision=bf16 to silence this).")

# recipe -> (first global batch of the miniature, max_steps of the first run, max_steps of the resumed run or None
# for the whole plan). 18 images: a batch of 8 is 2 steps an epoch, 16 is 1.
CASES = {
    "goyal_8k": (8, 3, 6),                 # 8192 -> 8; warm-up 0.1 -> 3.2 becomes 1e-4 -> 3.1e-3 (same 1:32)
    "lars_32k": (16, 3, 6),                # 32768 -> 16
    "mlperf_lars": (16, 3, 6),             # 32768 -> 16; label smoothing 0.1
    "sony_batch_control": (8, 9, 12),      # 34816 -> 69632 at epoch 5 becomes 8 -> 16: the resume crosses it (step 10)
    "collapsed_ensemble": (16, 40, None),  # 4096 -> 16: 72 steps; snapshot 1 at 36 in the first run, 2 and 3 after
    "collapsed_released": (16, 30, None),  # 4096 -> 16: 72 steps; one snapshot, after the collapse (67-71)
}


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    root, classes = ilsvrc(tmp_path_factory.mktemp("kaggle"), per_class=PER_CLASS, val_per_class=VAL_PER_CLASS)
    return root, classes


def miniature(name: str, batch: int, root: Path) -> list[str]:
    """The recipe's overrides for this machine and this miniature (module docstring), as `section.key=value`."""
    recipe = yaml.safe_load((RECIPES / f"imagenet_resnet50_{name}.yaml").read_text())
    phases = recipe["batch"].get("phases")
    factor = batch / (phases[0]["global_batch"] if phases else recipe["batch"]["global_batch"])
    sets = [f"data.root={root}", *CPU_MINIATURE]
    if phases:
        scaled = [{**p, "global_batch": round(p["global_batch"] * factor)} for p in phases]
        sets.append(f"batch.phases={json.dumps(scaled)}")
    else:
        sets.append(f"batch.global_batch={batch}")
    assert not recipe["schedule"].get("warmup_start_lr")   # a fixed non-zero start lr would not scale with the batch
    return sets


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _steps(directory: Path) -> list[int]:
    return sorted(json.loads(p.read_text())["step"] for p in directory.glob("*.json"))


@pytest.mark.parametrize("name", list(CASES))
def test_recipe_trains_evaluates_checkpoints_and_resumes(cli, tmp_path, imagenet, name):
    from largebatch import checkpoint, config
    from largebatch.schedule import Plan

    root, classes = imagenet
    batch, first, second = CASES[name]
    recipe = RECIPES / f"imagenet_resnet50_{name}.yaml"
    sets = miniature(name, batch, root)
    args = [a for s in sets for a in ("--set", s)]
    cfg = config.load(str(recipe), sets)
    plan = Plan(cfg.batch, cfg.optim, cfg.schedule, world_size=1, train_size=TRAIN_IMAGES, ensemble_cfg=cfg.ensemble)
    last = second or plan.total_steps
    run = tmp_path / "run"

    one = cli("train", recipe, "--run-dir", run, "--quiet", *args, "--set", f"train.max_steps={first}", check=True)
    assert one.stderr.count(FP16_LINE) == 1, one.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == first, summary
    assert summary["precision"] == "bf16" and summary["train_images"] == TRAIN_IMAGES, summary   # what ran
    assert summary["val_images"] == 3 * VAL_PER_CLASS
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["precision"] == "bf16"
    assert json.loads((run / "classes.json").read_text()) == classes
    assert first in _steps(run / "checkpoints")
    path, meta = checkpoint.latest(run / "checkpoints")
    assert meta["step"] == first and not checkpoint.load(path)["scaler"], "GradScaler enabled without fp16 on CUDA"
    evals = [r["step"] for r in _records(run) if r["kind"] == "eval"]
    assert evals and evals[-1] == first, evals

    two = cli("train", recipe, "--run-dir", run, "--resume", "--quiet", *args,
              *(["--set", f"train.max_steps={second}"] if second else []), check=True)
    assert two.stderr.count(FP16_LINE) == 1, two.stderr
    records = _records(run)
    resumed = [r for r in records if r["kind"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["step"] == first, resumed   # train.max_steps changed, recorded
    assert resumed[0]["changes"] == {"train.max_steps": [first, second]}, resumed
    train = [r for r in records if r["kind"] == "train"]
    steps = [r["step"] for r in train]
    assert steps == sorted(set(steps)) and steps[-1] == last and max(s for s in steps if s <= first) == first, steps
    assert [r for r in records if r["kind"] == "eval"][-1]["step"] == last
    for r in train:   # the recipe's schedule and batch phases at the miniature's batch, step by step
        assert r["lr"] == pytest.approx(plan.lr(r["step"] - 1), rel=1e-9), (r, name)
        assert r["global_batch"] == plan.phase_at(r["step"] - 1).global_batch, (r, name)
        assert r["nonfinite_steps"] == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == last and summary["precision"] == "bf16", summary
    assert last in _steps(run / "checkpoints")

    if name == "sony_batch_control":   # 8 images a step for 5 epochs (10 steps), then 16
        assert [(p.start_epoch, p.global_batch) for p in plan.phases] == [(0, 8), (5, 16)]
        assert {r["global_batch"] for r in train if r["step"] <= 10} == {8}
        assert {r["global_batch"] for r in train if r["step"] > 10} == {16} and summary["global_batch"] == 16
    if name == "collapsed_ensemble":   # a snapshot at the end of each segment (epochs 36, 54, 72); the ensemble
        assert plan.snapshot_steps() == [36, 54, 72] and _steps(run / "snapshots") == [36, 54, 72]
        ensembles = [r for r in records if r["kind"] == "ensemble"]
        assert [len(r["snapshots"]) for r in ensembles] == [1, 3], ensembles   # the first run stopped at 40
        assert "swa_top1" in ensembles[-1] and summary["ensemble_top1"] == ensembles[-1]["ensemble_top1"]
    if name == "collapsed_released":   # segments of their own and one collapse: one snapshot, at the very end
        assert plan.snapshot_steps() == [72] and _steps(run / "snapshots") == [72]
        assert [plan.in_collapse(k) for k in (66, 67, 71)] == [False, True, True]


@pytest.mark.parametrize("name", list(CASES))
def test_recipe_without_imagenet_names_data_root(cli, tmp_path, name):
    """The recipes say data.root /data/imagenet; where that is missing the run says, in one line, that data.root is
    the one thing to set, and writes no run directory."""
    if Path("/data/imagenet").exists():
        pytest.skip("/data/imagenet exists on this machine")
    run = tmp_path / "run"
    proc = cli("train", RECIPES / f"imagenet_resnet50_{name}.yaml", "--run-dir", run)
    user_error(proc, "ImageFolder root /data/imagenet does not exist", "set data.root to your ImageNet folder",
               "--set data.root=/path/to/imagenet")
    assert not run.exists()
