"""The step plan: lr at listed steps, phases, batch splitting."""
import math

import pytest

from largebatch.config import BatchConfig, OptimConfig, ScheduleConfig
from largebatch.errors import UserError
from largebatch.schedule import Plan, lr_at_epoch, scaled_lr, split_batch


def goyal_plan(world=256, batch=8192):
    # Goyal et al.: lr 0.1 per 256, 5 warm-up epochs from 0.1, /10 at 30, 60, 80; 90 epochs of ImageNet.
    return Plan(BatchConfig(global_batch=batch), OptimConfig(lr=0.1, nesterov=True, weight_decay=1e-4),
                ScheduleConfig(epochs=90, warmup_epochs=5, decay="step", milestones=[30, 60, 80], gamma=0.1),
                world_size=world, train_size=1281167)


def test_goyal_8k_values():
    p = goyal_plan()
    spe = 1281167 // 8192          # 156 steps per epoch, tail dropped
    assert p.phases[0].steps_per_epoch == spe == 156
    assert p.total_steps == 90 * spe
    assert p.phases[0].per_worker_batch == 32
    expected = {
        0: 0.1,                                   # warm-up starts at the unscaled lr
        spe * 5 // 2: 0.1 + (3.2 - 0.1) * 2.5 / 5,  # half-way through warm-up
        5 * spe: 3.2,                             # peak = 0.1 * 8192 / 256
        30 * spe - 1: 3.2,
        30 * spe: 0.32,
        60 * spe: 0.032,
        80 * spe: 0.0032,
        90 * spe - 1: 0.0032,
    }
    for step, lr in expected.items():
        assert p.lr(step) == pytest.approx(lr, rel=1e-9), step


def test_scaling_rules():
    assert scaled_lr(0.1, 8192) == pytest.approx(3.2)
    assert scaled_lr(0.1, 1024, rule="sqrt") == pytest.approx(0.2)
    assert scaled_lr(0.1, 1024, rule="none") == 0.1


def test_poly_and_cosine():
    kw = dict(peak_lr=1.0, start_lr=0.0, warmup_epochs=1.0, epochs=11.0, milestones=())
    assert lr_at_epoch(0.5, decay="poly", power=2, **kw) == pytest.approx(0.5)
    assert lr_at_epoch(6.0, decay="poly", power=2, **kw) == pytest.approx(0.25)
    assert lr_at_epoch(11.0, decay="poly", power=2, **kw) == pytest.approx(0.0)
    assert lr_at_epoch(6.0, decay="cosine", **kw) == pytest.approx(0.5)
    assert lr_at_epoch(1.0 + 10 / 3, decay="cosine", **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi / 3)))


def test_batch_phases_and_lr_jump():
    # Sony-style control: 1024 for 2 warm-up epochs, then 4096; lr follows the scaling rule per phase.
    p = Plan(BatchConfig(phases=[{"start_epoch": 0, "global_batch": 1024}, {"start_epoch": 2, "global_batch": 4096}]),
             OptimConfig(lr=0.1), ScheduleConfig(epochs=4, warmup_epochs=2, decay="constant"),
             world_size=4, train_size=40960)
    a, b = p.phases
    assert (a.steps_per_epoch, a.steps, a.per_worker_batch) == (40, 80, 256)
    assert (b.steps_per_epoch, b.steps, b.start_step, b.per_worker_batch) == (10, 20, 80, 1024)
    assert p.total_steps == 100
    assert p.lr(79) == pytest.approx(0.1 + (0.4 - 0.1) * 79 / 80)
    assert p.lr(80) == pytest.approx(1.6)
    assert p.position(80) == (2, 0) and p.position(95) == (3, 5)
    assert p.epoch_end_steps() == [40, 80, 90, 100]


def test_split_batch():
    assert split_batch(512, 2) == (256, 1)
    assert split_batch(512, 2, micro_batch=64) == (64, 4)
    assert split_batch(480, 4, micro_batch=50) == (40, 3)  # 120 per worker: smallest even split >= needed
    assert split_batch(512, 2, accumulation=4) == (64, 4)
    with pytest.raises(UserError, match="not divisible by the world size 3"):
        split_batch(512, 3)
    with pytest.raises(UserError, match="accumulation"):
        split_batch(512, 2, accumulation=3)


def test_phase_errors():
    with pytest.raises(UserError, match="start at epoch 0"):
        Plan(BatchConfig(phases=[{"start_epoch": 1, "global_batch": 64}]), OptimConfig(), ScheduleConfig(epochs=2),
             world_size=1, train_size=1000)
    with pytest.raises(UserError, match="larger than the 1000 training images"):
        Plan(BatchConfig(global_batch=2048), OptimConfig(), ScheduleConfig(epochs=2, warmup_epochs=0),
             world_size=1, train_size=1000)


def test_progressive_resizing():
    """data.resolution_phases: the size of the last phase started; None before the first; a resized
    batch is float in uint8/255 units, in the model's memory format."""
    import torch

    from largebatch.config import ResolutionPhase
    from largebatch.placement import resize_batch
    from largebatch.schedule import resolution_at

    phases = [ResolutionPhase(3, 28), ResolutionPhase(0.5, 20)]
    assert [resolution_at(phases, e) for e in (0, 0.49, 0.5, 2.99, 3, 10)] == [None, None, 20, 20, 28, 28]
    assert resolution_at([], 5) is None
    x = torch.full((2, 1, 28, 28), 255, dtype=torch.uint8)
    y = resize_batch(x, 20, channels_last=True)
    assert y.shape == (2, 1, 20, 20) and y.dtype == torch.float32
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(y, torch.ones_like(y))          # a flat image stays flat, in [0, 1] units


def test_default_warmup_never_starts_above_the_peak():
    """Goyal's default warm-up starts at the unscaled lr (the lr of reference_batch) and climbs to k times it.
    Below the reference batch (k < 1) it used to start above the peak and fall: batch 64 at lr 0.5 per 256
    began at 0.5 and fell to 0.125 over the warm-up. It starts at the peak there now."""
    def plan(batch: int) -> Plan:
        return Plan(BatchConfig(global_batch=batch), OptimConfig(lr=0.5, reference_batch=256),
                    ScheduleConfig(epochs=4, warmup_epochs=1, decay="step", milestones=[3]),
                    world_size=2, train_size=60000)
    small, large = plan(64), plan(512)
    assert small.lr(0) == pytest.approx(0.125) and max(small.lr(s) for s in range(small.total_steps)) == \
        pytest.approx(0.125)
    assert large.lr(0) == pytest.approx(0.5) and large.lr(large.step_at_epoch(1.0)) == pytest.approx(1.0)
    explicit = Plan(BatchConfig(global_batch=64), OptimConfig(lr=0.5, reference_batch=256),
                    ScheduleConfig(epochs=4, warmup_epochs=1, warmup_start_lr=0.5), world_size=2, train_size=60000)
    assert explicit.lr(0) == pytest.approx(0.5)   # an explicit start is the user's


@pytest.mark.parametrize("decay", ["cosine", "poly"])
def test_a_resume_that_lengthens_the_decay_stretches_it_from_the_resumed_epoch(decay):
    """A run of 4 epochs resumed at epoch 2 with 8: the lr at the resumed epoch is the one it had, the rest of
    the decay is stretched over epochs 2-8 and ends where the schedule ends; a second stretch (8 -> 12 at epoch 5)
    composes with the first. (A step decay's milestones are epochs of their own: its lr does not depend on the
    length, and the trainer stretches nothing there.)"""
    def plan(epochs, stretches=()):
        p = Plan(BatchConfig(global_batch=256), OptimConfig(lr=1.0), ScheduleConfig(
            epochs=epochs, warmup_epochs=1, decay=decay, end_lr=0.01),
            world_size=1, train_size=256 * 100)
        p.stretches = list(stretches)
        return p

    short, long_ = plan(4), plan(8, [(2.0, 4.0, 8.0)])
    per = 100   # steps per epoch
    assert long_.lr(2 * per) == pytest.approx(short.lr(2 * per))           # continuous at the resume
    assert long_.lr(5 * per) == pytest.approx(short.lr(3 * per))           # epoch 5 is the old epoch 3
    assert long_.lr(8 * per - 1) == pytest.approx(short.lr(4 * per - 1), rel=0.02)   # ends where the old one ended
    assert plan(8).lr(2 * per + 1) != pytest.approx(short.lr(2 * per + 1))  # unstretched: the lr would jump
    lrs = [long_.lr(s) for s in range(2 * per, 8 * per)]
    assert all(a >= b - 1e-12 for a, b in zip(lrs, lrs[1:]))               # still a decay
    twice = plan(12, [(2.0, 4.0, 8.0), (5.0, 8.0, 12.0)])
    assert twice.lr(5 * per) == pytest.approx(long_.lr(5 * per))
    assert twice.lr(12 * per - 1) == pytest.approx(short.lr(4 * per - 1), rel=0.02)
