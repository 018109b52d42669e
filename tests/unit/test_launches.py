"""Kernel launches of an optimizer step and of the EMA update on CUDA, counted on CPU with a model of torch's
multi-tensor rule: a `torch._foreach_*` op is one launch (its "fast route") when every tensor list holds tensors
of equal sizes and strides index by index, else one launch per tensor (a list of 0-dim tensors beside full ones
takes that slow path); any other op is one launch, a view none. torch also splits a fast-route op into chunks of
at most a few dozen tensors; the model counts one, so its figures are lower bounds and comparable.

`largebatch.optim.skip.Spread` turns a shared device scalar into buffers shaped like the list on CUDA
(`DENSE_DEVICES`); here "cpu" is added to that set to count what CUDA runs, and the dense form must give the very
numbers the list form gives.
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from largebatch import config
from largebatch.models import build_model
from largebatch.optim import build_ema, build_optimizer, skip, update_ema
from largebatch.step import set_lr

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

VIEWS = {"view", "_unsafe_view", "unbind", "select", "expand", "t", "detach", "alias", "as_strided", "permute",
         "unsqueeze", "squeeze", "split", "slice", "_record_function_enter_new", "_record_function_exit"}


class Launches(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count, self.by_op = 0, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[1]
        launches = 1
        if name in VIEWS:
            launches = 0
        elif name.startswith("_foreach_"):
            lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
            ref = lists[0]
            fast = all(len(lst) == len(ref) and all(x.shape == y.shape and x.stride() == y.stride()
                                                    for x, y in zip(lst, ref)) for lst in lists)
            launches = 1 if fast else len(ref)
        self.count += launches
        self.by_op[str(func)] += launches
        return func(*args, **(kwargs or {}))


def _resnet50():
    torch.manual_seed(0)
    model = build_model("resnet50", 1000, width=64).to(memory_format=torch.channels_last)
    return model


def _count_step(model, name: str, dense: bool, monkeypatch) -> tuple[int, dict]:
    monkeypatch.setattr(skip, "DENSE_DEVICES", {"cuda", "cpu"} if dense else {"cuda"})
    model = copy.deepcopy(model)   # copies no gradients: made here, alike for both forms
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(memory_format=torch.channels_last if p.ndim == 4 else
                                                        torch.contiguous_format) * 1e-3
    opt = build_optimizer(config.OptimConfig(name=name, lr=0.1, weight_decay=5e-5), model, lr=0.1)
    set_lr(opt, 0.1, static=True)
    opt.found_inf = torch.zeros(())   # type: ignore[attr-defined]  # the skip protocol, as the trainer runs it
    opt.step()   # lazy state
    with Launches() as launches:
        opt.step()
    return launches.count, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name, budget", [("sgd", 4), ("lars", 200), ("lamb", 600)])
def test_an_optimizer_step_stays_within_its_launch_budget_with_the_numbers_unchanged(monkeypatch, name, budget):
    """ResNet-50 (161 tensors): LARS's per-tensor trust ratios and LAMB's per-tensor bias corrections and ratios
    still take a launch per tensor each; every scalar shared by all tensors takes one."""
    model = _resnet50()
    listed, before = _count_step(model, name, False, monkeypatch)
    dense, after = _count_step(model, name, True, monkeypatch)
    assert 0 < dense <= budget, (name, dense)
    if name != "sgd":
        assert dense < listed - 100, (listed, dense)
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_the_ema_update_stays_within_its_launch_budget_with_the_numbers_unchanged(monkeypatch):
    base = _resnet50()
    results = []
    for dense in (False, True):
        model = copy.deepcopy(base)
        monkeypatch.setattr(skip, "DENSE_DEVICES", {"cuda", "cpu"} if dense else {"cuda"})
        ema = build_ema(model, 0.99)
        assert ema is not None
        update_ema(ema, model, torch.ones((), dtype=torch.float64))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)
        with Launches() as launches:
            update_ema(ema, model, torch.ones((), dtype=torch.float64))
            update_ema(ema, model, torch.zeros((), dtype=torch.float64))   # a skipped step
        results.append((launches.count, copy.deepcopy(ema.state_dict())))
    (listed, a), (dense_count, b) = results
    assert dense_count <= 2 * 30 and listed > 2 * 250, (listed, dense_count)   # per update: 267 tensors, 53 counts
    for k in a:
        assert torch.equal(a[k], b[k]), k
