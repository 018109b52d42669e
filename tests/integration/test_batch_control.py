"""Batch-size control and the Collapsed Ensemble schedule: listed values, momentum correction at the
jump, and a real 2-process run resumed at and inside phase boundaries equal to an uninterrupted one."""
import json

import pytest
import torch

from largebatch import checkpoint
from largebatch.config import BatchConfig, EnsembleConfig, OptimConfig, ScheduleConfig
from largebatch.errors import UserError
from largebatch.optim import build_optimizer
from largebatch.schedule import Plan

pytestmark = pytest.mark.timeout(300)


def test_phase_boundaries_listed_values():
    # 512 for 2 warm-up epochs, then 2048 (x4): steps per epoch 20 -> 5, lr by the linear rule per phase.
    p = Plan(BatchConfig(micro_batch=128, phases=[{"start_epoch": 0, "global_batch": 512},
                                                  {"start_epoch": 2, "global_batch": 2048}]),
             OptimConfig(lr=0.1), ScheduleConfig(epochs=5, warmup_epochs=2, decay="step", milestones=[4]),
             world_size=2, train_size=10240)
    a, b = p.phases
    assert (a.micro_batch, a.accumulation, a.steps_per_epoch, a.steps, a.peak_lr) == (128, 2, 20, 40, pytest.approx(0.2))
    assert (b.micro_batch, b.accumulation, b.steps_per_epoch, b.steps, b.start_step) == (128, 8, 5, 15, 40)
    assert b.peak_lr == pytest.approx(0.8)
    expected = {0: 0.1, 20: 0.15, 39: 0.1 + 0.1 * 39 / 40, 40: 0.8, 49: 0.8, 50: 0.08, 54: 0.08}
    for step, lr in expected.items():
        assert p.lr(step) == pytest.approx(lr), step
    assert p.total_steps == 55 and p.position(45) == (3, 0) and p.epoch_float(42) == pytest.approx(2.4)
    assert p.epoch_end_steps() == [20, 40, 45, 50, 55]


def test_batch_growth_replaces_lr_decay():
    # Smith et al.: constant lr, the batch grows x2 where step decay would divide the lr by 2.
    phases = [{"start_epoch": e, "global_batch": gb, "lr": 0.4} for e, gb in ((0, 256), (2, 512), (4, 1024))]
    p = Plan(BatchConfig(phases=phases), OptimConfig(lr=0.1), ScheduleConfig(epochs=6, warmup_epochs=0, decay="constant"),
             world_size=2, train_size=4096)
    assert [ph.global_batch for ph in p.phases] == [256, 512, 1024]
    assert [ph.steps for ph in p.phases] == [32, 16, 8]
    assert {p.lr(s) for s in range(p.total_steps)} == {0.4}


@pytest.mark.parametrize("name", ["sgd", "lars"])
def test_momentum_correction_at_the_jump(name):
    # Goyal: v <- m (lr_new / lr_old) v + lr_new g. With lr 0.1 then 0.4, and a BN-like 1-d parameter
    # (momentum SGD in both optimizers): step 2 moves w by 0.4 * (0.9 g1 + g2).
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    model = torch.nn.Module()
    model.w = w
    opt = build_optimizer(OptimConfig(name=name, weight_decay=0.0, momentum=0.9), model, lr=0.1)
    g1, g2 = torch.tensor([0.5, 1.0]), torch.tensor([-1.0, 2.0])
    for lr, g in ((0.1, g1), (0.4, g2)):
        for group in opt.param_groups:
            group["lr"] = lr
        before = w.detach().clone()
        w.grad = g.clone()
        opt.step()
    assert torch.allclose(before - w.detach(), 0.4 * (0.9 * g1 + g2), atol=1e-6)


def test_collapsed_ensemble_segments_listed_values():
    p = Plan(BatchConfig(global_batch=100), OptimConfig(lr=0.4, reference_batch=100),
             ScheduleConfig(epochs=4, warmup_epochs=1, warmup_start_lr=0.0, decay="poly", power=2),
             world_size=2, train_size=1000,
             ensemble_cfg=EnsembleConfig(cycles=2, cycle_epochs=3, rewarm_epochs=1, collapse_epochs=1,
                                         cycle_lr_factor=0.5, collapse_wd_factor=3.0))
    assert p.epochs == 10 and p.total_steps == 100
    assert [(g.kind, g.start_step, g.collapse_step, g.end_step, g.rewarm_steps) for g in p.segments] == [
        ("base", 0, 30, 40, 0), ("cycle", 40, 60, 70, 10), ("cycle", 70, 90, 100, 10)]
    assert p.snapshot_steps() == [40, 70, 100]
    expected = {
        5: 0.2,                              # warm-up 0 -> 0.4 over 10 steps
        20: 0.4 * (1 - 10 / 30) ** 2,        # base poly-2
        35: 0.4 * (1 - 25 / 30) ** 2,        # the collapse continues the poly-2 tail to zero
        40: 0.2 / 10, 49: 0.2,               # re-warm-up to 0.5 x 0.4
        55: 0.2 * (1 - 5 / 20) ** 2,         # cycle poly-2 to zero at step 70
        99: 0.2 * (1 - 19 / 20) ** 2,
    }
    for step, lr in expected.items():
        assert p.lr(step) == pytest.approx(lr), step
    collapse = [s for s in range(100) if p.in_collapse(s)]
    assert collapse == list(range(30, 40)) + list(range(60, 70)) + list(range(90, 100))
    assert p.weight_decay_factor(35) == 3.0 and p.weight_decay_factor(45) == 1.0
    with pytest.raises(UserError, match="cycle_epochs"):
        Plan(BatchConfig(global_batch=100), OptimConfig(), ScheduleConfig(epochs=4, warmup_epochs=1),
             world_size=1, train_size=1000, ensemble_cfg=EnsembleConfig(cycles=1, cycle_epochs=1.5, rewarm_epochs=1,
                                                                        collapse_epochs=1))


TINY = ["--set", "data.dataset=synthetic", "--set", "data.synthetic_size=512", "--set", "data.image_size=8",
        "--set", "data.num_classes=4", "--set", "model.width=4", "--set", "schedule.epochs=3",
        "--set", "schedule.warmup_epochs=1", "--set", "schedule.decay=poly",
        "--set", "batch.phases=[{start_epoch: 0, global_batch: 64}, {start_epoch: 1, global_batch: 128}]",
        "--set", "ensemble.cycles=1", "--set", "ensemble.cycle_epochs=2", "--set", "ensemble.rewarm_epochs=0.5",
        "--set", "ensemble.collapse_epochs=1", "--set", "train.plots=false", "--set", "train.log_every=4",
        "--set", "train.eval_every=0", "--quiet", "--nproc-per-node", "2"]


def _final_model(run_dir):
    path, meta = checkpoint.latest(run_dir / "checkpoints")
    return meta["step"], checkpoint.load(path)["model"]


def test_resume_across_phase_boundary_equals_uninterrupted(tmp_path, cli):
    # Phases: 8 steps at 64, then 4 steps per epoch at 128; base 3 epochs (collapse from epoch 2) + one cycle
    # of 2 epochs: 8 + 8 + 8 = 24 steps. Interrupted at the phase edge (step 8) and inside phase 2 (step 11).
    full, parts = tmp_path / "full", tmp_path / "parts"
    cli("train", *TINY, "--run-dir", full, check=True)
    cli("train", *TINY, "--run-dir", parts, "--set", "train.max_steps=8", check=True)
    cli("train", *TINY, "--run-dir", parts, "--set", "train.max_steps=11", "--set", "train.checkpoint_every=11",
        "--resume", check=True)
    cli("train", *TINY, "--run-dir", parts, "--resume", check=True)
    step_a, a = _final_model(full)
    step_b, b = _final_model(parts)
    assert step_a == step_b == 24
    assert a.keys() == b.keys()
    for k in a:
        if "running_" in k:
            # BN statistics are averaged over ranks whenever a checkpoint is written (the extra mid-epoch
            # checkpoint of the interrupted run): equal to rounding, and they do not enter training.
            assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6), k
        else:
            assert torch.equal(a[k], b[k]), k   # weights: bitwise
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (full, parts))
    assert [s["step"] for s in sa["snapshots"]] == [16, 24]
    assert sa["ensemble_top1"] == sb["ensemble_top1"]
    for x, y in zip(sa["snapshots"], sb["snapshots"]):
        assert x["top1"] == y["top1"] and x["loss"] == pytest.approx(y["loss"], rel=1e-5)
    train = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    batches = {r["step"]: r["global_batch"] for r in train if r["kind"] == "train"}
    assert batches[4] == 64 and batches[12] == 128
