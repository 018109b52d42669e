"""Every ImageNet recipe resolves to its paper's numbers on 256 and 2,048 workers (the --dry-run
arithmetic); the Fashion-MNIST counterparts keep the technique stack; LAMB and the sqrt rule
are selectable from a recipe and LAMB's first step matches a hand-computed update."""
import math

import pytest
import torch

from largebatch import config as config_mod
from largebatch.commands.train import dry_run
from largebatch.optim import LAMB, LARS, build_optimizer

pytestmark = pytest.mark.timeout(120)
IMAGENET = 1281167

# recipe -> (optimizer, global batches per phase, peak lr per phase, warm-up epochs, weight decay, epochs), each from
# the source its recipe names: Goyal et al. sections 2-5; the LARS paper's Table 4 row at 32K; Sony's 224 s run
# (secondary sources; lr and weight decay not available); the Collapsed Ensemble authors' released recipe (lr,
# warm-up, weight decay; the epoch split not available); MLPerf's resnet_ref_32768 (epochs: where its runs converged)
PAPERS = {
    "imagenet_resnet50_goyal_8k": ("sgd", [8192], [3.2], 5, 1e-4, 90),
    "imagenet_resnet50_lars_32k": ("lars", [32768], [40.0], 12, 5e-4, 100),
    "imagenet_resnet50_sony_batch_control": ("lars", [34816, 69632], [13.6, 27.2], 5, 5e-5, 90),
    "imagenet_resnet50_collapsed_ensemble": ("sgd", [4096], [1.6], 5, 5e-5, 72),
    "imagenet_resnet50_mlperf_lars": ("lars", [32768], [21.2], 16, 2.5e-5, 57),
    "imagenet_resnet50_collapsed_released": ("sgd", [4096], [1.6], 5, 5e-5, 72),
}


@pytest.mark.parametrize("world", [256, 2048])
@pytest.mark.parametrize("name", sorted(PAPERS))
def test_imagenet_recipe_dry_run(name, world):
    opt, batches, lrs, warmup, wd, epochs = PAPERS[name]
    cfg = config_mod.load(name)
    plan = dry_run(cfg, world)
    assert plan["model"] == "resnet50" and plan["optimizer"] == opt and plan["train_size"] == IMAGENET
    assert plan["precision"] == "fp16" and cfg.data.image_size == 224 and cfg.model.zero_init_residual
    assert plan["weight_decay"] == wd and plan["no_decay_bn_bias"] is True   # BN/bias excluded
    assert [p["global_batch"] for p in plan["phases"]] == batches
    assert [p["peak_lr"] for p in plan["phases"]] == pytest.approx(lrs)
    assert [p["per_worker_batch"] for p in plan["phases"]] == [b // world for b in batches]
    spe = [IMAGENET // b for b in batches]
    assert [p["steps_per_epoch"] for p in plan["phases"]] == spe
    assert plan["warmup_steps"] == round(warmup * spe[0])
    assert plan["epochs"] == epochs


def test_paper_specifics():
    goyal = dry_run(config_mod.load("imagenet_resnet50_goyal_8k"), 256)
    assert (goyal["warmup_start_lr"], goyal["warmup_steps"], goyal["total_steps"]) == (0.1, 780, 90 * 156)
    assert goyal["per_worker_batch"] == 32   # Goyal's n = 32
    sony = dry_run(config_mod.load("imagenet_resnet50_sony_batch_control"), 2048)
    assert [(p["start_epoch"], p["per_worker_batch"]) for p in sony["phases"]] == [(0, 17), (5, 34)]
    ce = dry_run(config_mod.load("imagenet_resnet50_collapsed_ensemble"), 256)
    assert [(g["kind"], g["start_epoch"], g["collapse_epoch"], g["end_epoch"]) for g in ce["ensemble"]] == [
        ("base", 0, 31, 36), ("cycle", 36, 49, 54), ("cycle", 54, 67, 72)]
    cfg = config_mod.load("imagenet_resnet50_collapsed_ensemble")
    assert cfg.ensemble.collapse_wd_factor == 4.0 and cfg.ensemble.collapse_epochs == 5   # 5e-5 -> 2e-4
    assert cfg.optim.nesterov is False   # the released recipe's plain momentum
    lars = config_mod.load("imagenet_resnet50_lars_32k")
    assert lars.optim.trust_coefficient == 0.001 and lars.schedule.decay == "poly" and lars.schedule.power == 2
    assert config_mod.load("imagenet_resnet50_goyal_8k").model.bn_batch == 32   # section 2.3: n = 32
    mlperf = config_mod.load("imagenet_resnet50_mlperf_lars")
    assert (mlperf.optim.momentum, mlperf.model.bn_batch, mlperf.schedule.end_lr, mlperf.train.label_smoothing) == (
        0.94, 128, 1e-4, 0.1)
    assert config_mod.load("imagenet_resnet50_sony_batch_control").train.label_smoothing == 0.0   # not the 122 s run's




@pytest.mark.parametrize("stem", ["goyal_8k", "lars_32k", "sony_batch_control", "collapsed_ensemble", "mlperf_lars",
                                  "collapsed_released"])
def test_fashion_mnist_counterparts(stem):
    fm = config_mod.load(f"fashion_mnist_{stem}", ["data.train_size=60000"])
    im = config_mod.load(f"imagenet_resnet50_{stem}")
    assert fm.data.dataset == "fashion_mnist" and fm.train.precision == "fp32"
    assert fm.optim.name == im.optim.name and fm.schedule.decay == im.schedule.decay
    assert len(fm.batch.phases) == len(im.batch.phases) and fm.ensemble.cycles == im.ensemble.cycles
    plan = dry_run(fm, 2)
    assert plan["total_steps"] > 0 and all(p["global_batch"] <= 60000 // 20 for p in plan["phases"])


def test_lamb_and_sqrt_rule_from_a_recipe():
    cfg = config_mod.load("fashion_mnist", ["optim.name=lamb", "optim.scaling_rule=sqrt", "optim.lr=0.01",
                                            "optim.weight_decay=0.1", "batch.global_batch=1024",
                                            "data.train_size=60000"])
    assert dry_run(cfg, 2)["peak_lr"] == pytest.approx(0.01 * math.sqrt(1024 / 256))
    model = torch.nn.Linear(2, 1, bias=True)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 4.0]]))
        model.bias.fill_(1.0)
    opt = build_optimizer(cfg.optim, model, lr=0.02)
    assert isinstance(opt, LAMB)
    g = torch.tensor([[0.3, -0.4]])
    model.weight.grad, model.bias.grad = g.clone(), torch.tensor([2.0])
    opt.step()
    # Step 1 by hand: m_hat = g, v_hat = g^2, r = g / (|g| + eps) = sign(g); u = r + 0.1 w;
    # ratio = ||w|| / ||u||; w -= lr * ratio * u. The bias (excluded): w -= lr * sign(g), no decay/trust ratio.
    w = torch.tensor([[3.0, 4.0]])
    r = g / (g.abs() + 1e-6)
    u = r + 0.1 * w
    want = w - 0.02 * (w.norm() / u.norm()) * u
    assert torch.allclose(model.weight.detach(), want, atol=1e-6)
    assert model.bias.item() == pytest.approx(1.0 - 0.02 * 2.0 / (2.0 + 1e-6))
    cfg_lars = config_mod.load("fashion_mnist_lars_32k")
    assert isinstance(build_optimizer(cfg_lars.optim, model, lr=1.0), LARS)


def test_the_released_collapsed_ensemble_schedule_is_the_authors():
    """sara-nl/caffe's resnet50_custom_lr at 4,096 (312 steps an epoch): base poly-1
    over a 60-epoch horizon stopped at 25, segments peaking at 1.02, 0.764, 0.572 with 3-epoch re-warm-ups from
    where the previous one ended, each ending at a quarter of its peak, one collapse from 0.143 to 0 at 4x weight
    decay, one snapshot."""
    from largebatch.schedule import Plan

    cfg = config_mod.load("imagenet_resnet50_collapsed_released")
    plan = Plan(cfg.batch, cfg.optim, cfg.schedule, world_size=128, train_size=IMAGENET, ensemble_cfg=cfg.ensemble)
    spe = plan.phases[0].steps_per_epoch
    assert plan.epochs == 72 and plan.snapshot_steps() == [plan.total_steps]

    def lr(epoch):
        return plan.lr(min(round(epoch * spe), plan.total_steps - 1))
    assert lr(0) == pytest.approx(0.1) and lr(5) == pytest.approx(1.6)
    assert lr(25) == pytest.approx(1.02) and lr(37 - 1 / spe) == pytest.approx(0.255, abs=1e-3)
    assert lr(40) == pytest.approx(0.764, abs=1e-3) and lr(52 - 1 / spe) == pytest.approx(0.191, abs=1e-3)
    assert lr(55) == pytest.approx(0.572, abs=1e-3) and lr(67) == pytest.approx(0.143, abs=1e-3)
    assert lr(72) == pytest.approx(0.0, abs=1e-3)
    assert not plan.in_collapse(round(66.9 * spe)) and plan.in_collapse(round(67 * spe))
    assert plan.weight_decay_factor(round(68 * spe)) == 4.0 and plan.weight_decay_factor(round(60 * spe)) == 1.0
    with pytest.raises(config_mod.UserError, match="ensemble.segments has no collapse"):
        config_mod.load("imagenet_resnet50_collapsed_released", ["ensemble.segments=[{epochs: 5}]"])
    with pytest.raises(config_mod.UserError, match="give one of them"):
        config_mod.load("imagenet_resnet50_collapsed_released", ["ensemble.cycles=2"])


def test_the_released_schedule_study_scales_the_recipe_to_the_budget():
    """`study ensemble --own-schedule` (experiments/collapsed_released.yaml): the ensemble variant is the recipe's
    own base run and segments scaled to --epochs, the single model is the base form for all of them; both plan."""
    import yaml

    from largebatch.commands import experiment
    from largebatch.commands.study.kinds import parser
    from largebatch.commands.study.plan import variants

    args = parser("ensemble").parse_args(
        ["--recipe", "fashion_mnist_collapsed_released", "--own-schedule", "--epochs", "24", "--batch", "192",
         "--set", "model.width=8"])
    plan = variants("ensemble", args)
    single = config_mod.load(args.recipe, list(args.overrides) + plan["single"] + ["data.train_size=60000"])
    ens = config_mod.load(args.recipe, list(args.overrides) + plan["ensemble"] + ["data.train_size=60000"])
    assert single.schedule.epochs == 24 and not single.ensemble.segments and single.schedule.decay_epochs is None
    assert ens.schedule.epochs == pytest.approx(25 / 3, abs=1e-3) and ens.schedule.decay_epochs == pytest.approx(20)
    assert [g.epochs for g in ens.ensemble.segments] == pytest.approx([4, 5, 5, 5 / 3], abs=1e-3)
    assert [g.collapse for g in ens.ensemble.segments] == [False, False, False, True]
    assert dry_run(ens, 2)["epochs"] == pytest.approx(24, abs=0.01) and len(dry_run(ens, 2)["ensemble"]) == 5
    with pytest.raises(config_mod.UserError, match="--own-schedule takes the recipe's ensemble.segments"):
        variants("ensemble", parser("ensemble").parse_args(["--own-schedule"]))
    spec = yaml.safe_load(experiment.resolve("collapsed_released").read_text())
    assert spec["common"]["own_schedule"] is True and spec["common"]["recipe"] == "fashion_mnist_collapsed_released"
