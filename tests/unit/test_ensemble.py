"""Collapsed Ensemble evaluation: snapshot and ensemble metrics equal a hand-computed softmax average,
in one process and through `largebatch evaluate --ensemble` on 2 real processes; SWA helpers."""

import pytest
import torch

from largebatch import ensemble
from largebatch.config import Config
from largebatch.data import build_data
from largebatch.models.classifier import build_classifier

pytestmark = pytest.mark.timeout(180)


def _tiny_cfg() -> Config:
    cfg = Config()
    cfg.data.dataset, cfg.data.synthetic_size, cfg.data.image_size, cfg.data.num_classes = "synthetic", 256, 8, 4
    cfg.model.width = 4
    cfg.train.plots = False
    return cfg


def _snapshots(cfg, info, n=3):
    states = []
    for seed in range(n):
        torch.manual_seed(100 + seed)
        model = build_classifier(cfg.model, info)
        for p in model.parameters():   # random weights everywhere (zero-init gammas would make members alike)
            p.data.normal_(0, 0.5)
        states.append(model.state_dict())
    return model, states


def _hand(cfg, states, test, flip=False):
    """Softmax of every member on every test image (with `flip`: of the logits averaged over the image and its
    mirror), averaged; top-1 by argmax, NLL of the average."""
    x, y = next(test.batches([torch.arange(len(test))], train=False, epoch=0))
    probs = []
    for st in states:
        m = build_classifier(cfg.model, _info(cfg))
        m.load_state_dict(st)
        m.eval()
        with torch.no_grad():
            logits = (m(x) + m(x.flip(3))) / 2 if flip else m(x)
            probs.append(logits.softmax(1))
    avg = torch.stack(probs).mean(0)
    member_top1 = [(p.argmax(1) == y).double().mean().item() for p in probs]
    return member_top1, (avg.argmax(1) == y).double().mean().item(), -avg[torch.arange(len(y)), y].log().mean().item()


def _info(cfg):
    return build_data(cfg.data, cfg.train.seed)[2]


def test_ensemble_equals_hand_computed_softmax_average():
    cfg = _tiny_cfg()
    _, test, info = build_data(cfg.data, cfg.train.seed)
    model, states = _snapshots(cfg, info)
    got = ensemble.evaluate_snapshots(model, states, test, 0, 1, torch.device("cpu"), batch=7)
    members, ens_top1, ens_nll = _hand(cfg, states, test)
    assert [s["top1"] for s in got["snapshots"]] == pytest.approx(members, abs=1e-12)
    assert got["ensemble"]["top1"] == pytest.approx(ens_top1, abs=1e-12)
    assert got["ensemble"]["loss"] == pytest.approx(ens_nll, rel=1e-5)
    assert got["ensemble"]["count"] == len(test) == 32
    assert len({*members, ens_top1}) > 1   # the members really differ, so the average is a real test


def test_with_eval_flip_every_member_is_scored_as_the_runs_own_evaluation():
    """train.eval_flip scores a single model over each image and its mirror; the snapshots, their ensemble and
    the weight average must be scored the same way, or the ensemble study compares unlike with unlike."""
    cfg = _tiny_cfg()
    _, test, info = build_data(cfg.data, cfg.train.seed)
    model, states = _snapshots(cfg, info)
    got = ensemble.evaluate_snapshots(model, states, test, 0, 1, torch.device("cpu"), flip=True, batch=7)
    members, ens_top1, ens_nll = _hand(cfg, states, test, flip=True)
    assert [s["top1"] for s in got["snapshots"]] == pytest.approx(members, abs=1e-12)
    assert got["ensemble"]["top1"] == pytest.approx(ens_top1, abs=1e-12)
    assert got["ensemble"]["loss"] == pytest.approx(ens_nll, rel=1e-5)
    plain = ensemble.evaluate_snapshots(model, states, test, 0, 1, torch.device("cpu"), batch=7)
    assert plain["ensemble"]["loss"] != pytest.approx(got["ensemble"]["loss"], rel=1e-5)   # the mirror counts




def test_average_states_and_bn_recompute():
    a = {"w": torch.tensor([1.0, 3.0]), "n": torch.tensor(5)}
    b = {"w": torch.tensor([3.0, 5.0]), "n": torch.tensor(7)}
    avg = ensemble.average_states([a, b])
    assert torch.equal(avg["w"], torch.tensor([2.0, 4.0])) and avg["n"].item() == 7

    class Src:   # a source of fixed float batches
        def batches(self, index_batches, *, train, epoch):
            for i in index_batches:
                yield data[i], torch.zeros(len(i), dtype=torch.int64)

    torch.manual_seed(0)
    data = torch.randn(40, 3, 2, 2) * 2 + 1
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(3))
    ensemble.recompute_bn(model, Src(), list(torch.arange(40).split(8)), torch.device("cpu"), channels_last=False,
                          precision="fp32", world_size=1)
    bn = model[0]
    assert torch.allclose(bn.running_mean, data.mean((0, 2, 3)), atol=1e-5)
    assert bn.momentum == 0.1 and not bn.training


def test_collapse_weight_decay_multiplier():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": [model.weight], "weight_decay": 1e-4},
                           {"params": [model.bias], "weight_decay": 0.0}], lr=0.1)
    base = [g["weight_decay"] for g in opt.param_groups]
    ensemble.set_weight_decay(opt, base, 3.0)
    assert [g["weight_decay"] for g in opt.param_groups] == [pytest.approx(3e-4), 0.0]
    ensemble.set_weight_decay(opt, base, 1.0)
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-4, 0.0]
