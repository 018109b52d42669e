"""The speed-run pieces: SpeedrunNet, the recipe, and the plain PyTorch baseline's model and errors."""
import json

import pytest
import torch

from largebatch import config
from largebatch.commands.bench.baselines import plain_cnn
from largebatch.models import build_model, count_macs
from largebatch.models.speedrun import SpeedrunNet


def test_speedrun_net_shapes_cost_and_zero_init():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = build_model("speedrun", num_classes=10, in_channels=1, stem="small", width=8)
    assert isinstance(net, SpeedrunNet)
    x = torch.randn(4, 1, 28, 28)
    out = net(x)
    assert out.shape == (4, 10) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for p in net.parameters())
    # every stage starts as conv -> pool -> BN -> GELU: the second branch is exactly zero
    assert all(torch.all(s.last_bn.weight == 0) for s in net.stages)
    # hand count at width 8, 28 px: stem 28*28*9*1*8; stages (28,14), (14,7), (7,3) px; fc 64*10
    w = 8
    expect = 28 * 28 * 9 * w + sum(a * a * 9 * ci * co + b * b * 9 * co * co
                                   for a, b, ci, co in ((28, 14, w, 2 * w), (14, 7, 2 * w, 4 * w), (7, 3, 4 * w, 8 * w)))
    assert count_macs(net, (1, 1, 28, 28)) == expect + 8 * w * 10
    no_zero = build_model("speedrun", 10, in_channels=1, width=8, zero_init_residual=False)
    assert all(torch.all(s.last_bn.weight == 1) for s in no_zero.stages)
    # the activation switch: ReLU everywhere GELU was, same parameters; an unknown name is refused
    relu = SpeedrunNet(10, 1, width=8, act="relu")
    kinds = {type(m) for m in relu.modules()}
    assert torch.nn.ReLU in kinds and torch.nn.GELU not in kinds
    assert [p.shape for p in relu.parameters()] == [p.shape for p in net.parameters()]
    with pytest.raises(ValueError, match="act must be one of"):
        SpeedrunNet(10, 1, width=8, act="tanh")


def test_speedrun_recipe_resolves(cli):
    cfg = config.load("fashion_mnist_speedrun")
    assert cfg.model.name == "speedrun" and cfg.train.eval_flip and cfg.data.dataset == "fashion_mnist"
    proc = cli("train", "fashion_mnist_speedrun", "--dry-run", "--world-size", "2", check=True)
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plan["model"] == "speedrun" and plan["per_worker_batch"] * 2 == plan["global_batch"]
    assert "largebatch train --dry-run: fashion_mnist_speedrun" in proc.stdout   # the dry run names itself, not plan


def test_plain_cnn_and_bench_speedrun_user_error(cli):
    assert plain_cnn()(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    proc = cli("bench", "speedrun", "--target", "1.5")
    if proc.returncode == 2 and "unknown command" in proc.stderr:   # no cli.py entry yet: the module path
        proc = __import__("subprocess").run([__import__("sys").executable, "-m", "largebatch.commands.bench.speedrun",
                                             "--target", "1.5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--target" in proc.stderr and "Traceback" not in proc.stderr
