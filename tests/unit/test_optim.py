"""Optimisers: LARS and LAMB against updates computed here from the papers' formulas with numpy,
parameter groups by shape, build_optimizer, and every registered optimizer on the same small problem."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from largebatch.config import OptimConfig
from largebatch.errors import UserError
from largebatch.models import build_model
from largebatch.optim import LAMB, LARS, OPTIMIZERS, build_optimizer, param_groups

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]


# Four tensors: an ordinary weight, a second weight, a weight that is all zeros (||w|| = 0), and one
# whose gradient is zero at the first step (||g|| = 0); plus a "BN" vector in an excluded group.
RNG = np.random.default_rng(0)
INIT = [RNG.normal(size=(3, 2)), RNG.normal(size=(2, 2, 1, 1)), np.zeros((4,)), RNG.normal(size=(5,)), RNG.normal(size=(3,))]
STEPS = 4
GRADS = [[RNG.normal(size=w.shape) for w in INIT] for _ in range(STEPS)]
GRADS[0][3][:] = 0.0
LRS = [0.5, 0.5, 0.2, 0.8]  # the lr changes twice: momentum correction must apply
GROUPS = [([0, 1, 2, 3], {"weight_decay": 0.01}), ([4], {"weight_decay": 0.05, "lars_exclude": True})]


def _run(make_opt, lrs=LRS, steps=STEPS) -> list[np.ndarray]:
    params = [torch.tensor(w, dtype=torch.float64, requires_grad=True) for w in INIT]
    opt = make_opt([{"params": [params[i] for i in idx], **kw} for idx, kw in GROUPS])
    for t in range(steps):
        for p, g in zip(params, GRADS[t]):
            p.grad = torch.tensor(g, dtype=torch.float64)
        for group in opt.param_groups:
            group["lr"] = lrs[t]
        opt.step()
    return [p.detach().numpy() for p in params]


def _lars_reference(momentum: float, eta: float, eps: float, nesterov: bool, lrs=LRS, steps=STEPS) -> list[np.ndarray]:
    """Algorithm 1 of You et al. with Goyal's momentum correction, written out per tensor."""
    ws = [w.copy() for w in INIT]
    vs = [np.zeros_like(w) for w in INIT]
    settings = {i: kw for idx, kw in GROUPS for i in idx}
    for t in range(steps):
        lr = lrs[t]
        correction = lr / lrs[t - 1] if t > 0 else 1.0
        for i, (w, g) in enumerate(zip(ws, GRADS[t])):
            wd, exclude = settings[i]["weight_decay"], settings[i].get("lars_exclude", False)
            wn, gn = np.linalg.norm(w), np.linalg.norm(g)
            lam = 1.0 if (exclude or wn == 0 or gn == 0) else eta * wn / (gn + wd * wn + eps)
            d = lr * lam * (g + wd * w)
            vs[i] = momentum * correction * vs[i] + d
            ws[i] = w - (momentum * vs[i] + d if nesterov else vs[i])
    return ws


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_lars_matches_algorithm_1(nesterov: bool, eps: float) -> None:
    got = _run(lambda g: LARS(g, lr=LRS[0], momentum=0.9, trust_coefficient=0.02, eps=eps, nesterov=nesterov))
    want = _lars_reference(0.9, 0.02, eps, nesterov)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    # the zero-norm tensors did move (lambda = 1), and by a plain SGD step at step 1
    assert np.abs(got[2]).sum() > 0


def test_lars_one_step_by_hand() -> None:
    # ||w|| = 5, ||g|| = 1, eta = 0.1, no weight decay: lambda = 0.5, v = 1 * 0.5 * g = (0.3, 0.4).
    w = torch.tensor([3.0, 4.0], requires_grad=True)
    w.grad = torch.tensor([0.6, 0.8])
    opt = LARS([w], lr=1.0, momentum=0.9, trust_coefficient=0.1)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.tensor([2.7, 3.6]))
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], torch.tensor([0.3, 0.4]))
    # step 2 at lr 2 with the same gradient: v = 0.9 * (2/1) * v + 2 * (0.1 * 4.5 / 1) * g
    opt.param_groups[0]["lr"] = 2.0
    opt.step()
    v = 0.9 * 2 * np.array([0.3, 0.4]) + 2 * 0.45 * np.array([0.6, 0.8])
    np.testing.assert_allclose(w.detach().numpy(), np.array([2.7, 3.6]) - v, rtol=1e-6)


def test_lars_state_dict_round_trip_keeps_momentum_correction() -> None:
    make = lambda g: LARS(g, lr=LRS[0], momentum=0.9, trust_coefficient=0.02, nesterov=True)  # noqa: E731
    params = [torch.tensor(w, dtype=torch.float64, requires_grad=True) for w in INIT]
    opt = make([{"params": [params[i] for i in idx], **kw} for idx, kw in GROUPS])
    for t in range(2):
        for p, g in zip(params, GRADS[t]):
            p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert all(group["prev_lr"] == LRS[1] for group in saved["param_groups"])
    # a fresh optimizer (fresh lr in its constructor) on copies of the weights
    params2 = [p.detach().clone().requires_grad_() for p in params]
    opt2 = LARS([{"params": [params2[i] for i in idx], **kw} for idx, kw in GROUPS], lr=123.0, momentum=0.9,
                trust_coefficient=0.02, nesterov=True)
    opt2.load_state_dict(saved)
    for t in (2, 3):
        for o, ps in ((opt, params), (opt2, params2)):
            for p, g in zip(ps, GRADS[t]):
                p.grad = torch.tensor(g, dtype=torch.float64)
            for group in o.param_groups:
                group["lr"] = LRS[t]
            o.step()
    want = _lars_reference(0.9, 0.02, 0.0, True)
    for a, b, c in zip(params, params2, want):
        assert torch.equal(a, b)
        np.testing.assert_allclose(b.detach().numpy(), c, rtol=1e-10, atol=1e-12)


def _lamb_reference(betas, eps, wd, bias_correction, lrs=LRS, steps=STEPS) -> list[np.ndarray]:
    """Algorithm 2 of You et al. 2019, written out per tensor; excluded groups get Adam."""
    b1, b2 = betas
    ws = [w.copy() for w in INIT]
    ms = [np.zeros_like(w) for w in INIT]
    vs = [np.zeros_like(w) for w in INIT]
    excluded = {i for idx, kw in GROUPS if kw.get("lars_exclude") for i in idx}
    for t in range(steps):
        for i, (w, g) in enumerate(zip(ws, GRADS[t])):
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            m_hat = ms[i] / (1 - b1 ** (t + 1)) if bias_correction else ms[i]
            v_hat = vs[i] / (1 - b2 ** (t + 1)) if bias_correction else vs[i]
            r = m_hat / (np.sqrt(v_hat) + eps)
            if i in excluded:
                ws[i] = w - lrs[t] * r
                continue
            u = r + wd * w
            wn, un = np.linalg.norm(w), np.linalg.norm(u)
            ratio = wn / un if wn > 0 and un > 0 else 1.0
            ws[i] = w - lrs[t] * ratio * u
    return ws


@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_matches_algorithm_2(bias_correction: bool) -> None:
    global GROUPS
    saved = GROUPS
    GROUPS = [([0, 1, 2, 3], {"weight_decay": 0.01}), ([4], {"weight_decay": 0.0, "lars_exclude": True})]
    try:
        got = _run(lambda g: LAMB(g, lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01,
                                  bias_correction=bias_correction))
        want = _lamb_reference((0.9, 0.99), 1e-6, 0.01, bias_correction)
    finally:
        GROUPS = saved
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_lars_never_reads_tensor_values_on_the_host() -> None:
    # On the meta device every tensor has a shape but no value: .item(), `if tensor` or a host
    # copy would raise. Both optimizers must step through without touching values.
    w = torch.empty(4, 3, device="meta", requires_grad=True)
    b = torch.empty(3, device="meta", requires_grad=True)
    w.grad, b.grad = torch.empty_like(w), torch.empty_like(b)
    groups = lambda: [{"params": [w], "weight_decay": 1e-4}, {"params": [b], "lars_exclude": True}]  # noqa: E731
    LARS(groups(), lr=0.1, nesterov=True).step()
    LAMB(groups(), lr=0.1, weight_decay=1e-4).step()


def test_param_groups_by_shape_include_shortcut_bn_and_biases() -> None:
    model = build_model("resnet18", 10, stem="small", width=8)
    groups = param_groups(model, 1e-4)
    assert len(groups) == 2
    decay, excluded = groups
    assert decay["weight_decay"] == 1e-4 and not decay.get("lars_exclude", False)
    assert excluded["weight_decay"] == 0.0 and excluded["lars_exclude"] is True
    ids = {id(p) for p in excluded["params"]}
    shortcut_bn = model.layer2[0].shortcut[1]
    assert id(shortcut_bn.weight) in ids and id(shortcut_bn.bias) in ids
    assert id(model.fc.bias) in ids and id(model.fc.weight) not in ids
    assert all(p.ndim <= 1 for p in excluded["params"]) and all(p.ndim > 1 for p in decay["params"])
    assert len(ids) + len(decay["params"]) == len(list(model.parameters()))


def test_build_optimizer_groups_and_errors() -> None:
    model = build_model("resnet18", 10, stem="small", width=8)
    for name in OPTIMIZERS:
        opt = build_optimizer(OptimConfig(name=name, weight_decay=1e-4), model, lr=0.1)
        assert [g.get("lars_exclude", False) for g in opt.param_groups] == [False, True]
        assert [g["weight_decay"] for g in opt.param_groups] == [1e-4, 0.0]
        single = build_optimizer(OptimConfig(name=name, weight_decay=1e-4, no_decay_bn_bias=False), model, lr=0.1)
        assert len(single.param_groups) == 1 and single.param_groups[0]["weight_decay"] == 1e-4
        assert not single.param_groups[0].get("lars_exclude", False)
    assert isinstance(build_optimizer(OptimConfig(name="lars"), model, 0.1), LARS)
    assert isinstance(build_optimizer(OptimConfig(name="lamb"), model, 0.1), LAMB)
    sgd = build_optimizer(OptimConfig(name="sgd", nesterov=True), model, 0.1)
    assert sgd.param_groups[0]["nesterov"] and sgd.param_groups[0]["fused"]
    with pytest.raises(UserError):
        build_optimizer(OptimConfig(name="adamw"), model, 0.1)
    with pytest.raises(UserError):
        build_optimizer(OptimConfig(name="sgd", momentum=0.0, nesterov=True), model, 0.1)
    with pytest.raises(ValueError):
        LARS(model.parameters(), lr=-1.0)
    with pytest.raises(ValueError):
        LAMB(model.parameters(), lr=0.1, eps=0.0)


# Peak lr (and other settings) per registered optimizer for the shared problem below; a new optimizer
# needs an entry here. LARS gives the excluded biases the raw lr, so its eta is raised instead of its lr.
PROBLEM = {"sgd": (0.05, {}), "lars": (0.1, {"trust_coefficient": 0.1}), "lamb": (0.05, {})}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_fits_a_small_regression(name: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 2) + 0.5
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    peak, settings = PROBLEM[name]
    opt = build_optimizer(OptimConfig(name=name, weight_decay=1e-5, nesterov=True, **settings), model, peak)
    steps = 150
    first = None
    for t in range(steps):
        for g in opt.param_groups:
            g["lr"] = peak * (1 - t / steps) ** 2  # poly-2 decay, as in the LARS paper
        loss = nn.functional.mse_loss(model(x), y)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    final = nn.functional.mse_loss(model(x), y).item()
    assert math.isfinite(final) and final < 0.02 * first, (name, first, final)
