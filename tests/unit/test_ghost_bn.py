"""BatchNorm over a fixed number of images (`model.bn_batch`, largebatch/models/ghost_bn.py): against torch's
BatchNorm applied to each group alone, outputs, gradients and running statistics; evaluation unchanged; the
state dict unchanged; a run with it trains and a bad value is one sentence."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from largebatch import config
from largebatch.errors import UserError
from largebatch.models import build_model
from largebatch.models.ghost_bn import GhostBatchNorm2d, apply_bn_batch

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]


@pytest.mark.parametrize("channels_last", [False, True])
def test_each_group_is_normalised_as_batchnorm_given_that_group_alone(channels_last):
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(6)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    ghost = copy.deepcopy(ref)
    apply_bn_batch(ghost, 4)
    assert type(ghost) is GhostBatchNorm2d
    x = torch.randn(10, 6, 5, 5) * 3 + 1   # groups of 4, 4 and 2
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = ghost(xa)
    want = torch.cat([ref(chunk) for chunk in xb.split(4)])   # running stats updated per group, in order
    assert torch.allclose(out, want, atol=1e-6)
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    (want * torch.arange(want.numel()).view_as(want)).sum().backward()
    assert torch.allclose(xa.grad, xb.grad, atol=1e-5) and torch.allclose(ghost.weight.grad, ref.weight.grad, atol=1e-4)
    assert torch.allclose(ghost.running_mean, ref.running_mean) and torch.allclose(ghost.running_var, ref.running_var)
    assert int(ghost.num_batches_tracked) == 3
    whole = nn.BatchNorm2d(6)
    whole.load_state_dict(ref.state_dict())
    assert not torch.allclose(whole.train()(x), out, atol=1e-3)   # the whole batch's statistics differ
    ghost.eval()
    whole.eval()
    whole.load_state_dict(ghost.state_dict())
    assert torch.equal(ghost(x), whole(x))   # evaluation: the running statistics, as torch's


def test_a_resnet_keeps_its_state_dict_and_every_bn_layer_takes_the_groups():
    net = build_model("resnet18", 10, width=8, stem="small")
    keys = list(net.state_dict())
    other = apply_bn_batch(net, 32)
    assert other == [] and list(net.state_dict()) == keys
    bns = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(type(m) is GhostBatchNorm2d and m.bn_batch == 32 for m in bns)


def test_a_run_with_bn_batch_trains_and_a_bad_value_is_one_sentence(tmp_path):
    from largebatch.trainer import Trainer

    sets = ["model.name=resnet18", "model.width=4", "data.dataset=synthetic", "data.synthetic_size=64",
            "data.image_size=16", "batch.global_batch=16", "train.max_steps=2", "train.plots=false"]
    runs = []
    for extra in ([], ["model.bn_batch=4"]):
        trainer = Trainer(config.load("fashion_mnist", sets + extra), tmp_path / str(len(runs)), quiet=True)
        trainer.fit()
        runs.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
        trainer.close()
    assert any(not torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    with pytest.raises(UserError, match="model.bn_batch is 0; it must be positive."):
        config.load("fashion_mnist", ["model.bn_batch=0"])
