"""The training step without host synchronisation (largebatch/step.py, largebatch/optim/skip.py): no scalar is
read on the host and no tensor is made from host data inside a step, a non-finite step is still skipped,
counted and stopped after `train.max_nonfinite`; LARS and LAMB with device lrs and a device skip flag equal
their float form (and the papers' formulas) over a schedule with warm-up and decay; the device EMA equals
torch's AveragedModel."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from largebatch import config
from largebatch.errors import UserError
from largebatch.optim import LAMB, LARS, SGD, build_ema, update_ema

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread")]

# What reads a tensor's value on the host (a stream sync on CUDA), at the Python and at the dispatcher level,
# and what builds a tensor from host data (a synchronous copy from pageable memory on CUDA).
HOST_READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy"}
DISPATCH_SYNCS = {torch.ops.aten._local_scalar_dense.default: "a scalar read on the host",
                  torch.ops.aten.lift_fresh.default: "a tensor made from host data"}


class HostSyncs(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


class DispatchSyncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in DISPATCH_SYNCS:
            self.seen.append(DISPATCH_SYNCS[func])
        return func(*args, **(kwargs or {}))


def _trainer(tmp_path, *sets):
    from largebatch.trainer import Trainer

    cfg = config.load("fashion_mnist", [
        "model.width=4", "data.dataset=synthetic", "data.synthetic_size=128", "data.image_size=16",
        "batch.global_batch=32", "train.log_every=1", "train.plots=false", "train.max_steps=6", *sets])
    return Trainer(cfg, tmp_path / "run", quiet=True)


@pytest.mark.parametrize("optim", ["sgd", "lars", "lamb"])
def test_a_training_step_makes_no_host_sync_and_still_skips_a_nonfinite_step(tmp_path, monkeypatch, optim):
    monkeypatch.setenv("LARGEBATCH_FAULTS", "nan@0:2")
    trainer = _trainer(tmp_path, f"optim.name={optim}", "train.ema=0.9", "train.label_smoothing=0.1")
    try:
        steps = list(trainer.batches.steps(0, 4))
        before = None
        for step, (phase, micros, _) in enumerate(steps):
            if step == 2:
                before = copy.deepcopy(trainer.model.state_dict()), copy.deepcopy(trainer.ema.state_dict())
            with HostSyncs() as py, DispatchSyncs() as disp:
                trainer.train_step(step, micros, phase, trainer.plan.lr(step))
            assert py.seen == [] and disp.seen == [], (step, py.seen, disp.seen)
            if step == 2:   # the poisoned step changed no weight and no EMA weight
                assert before is not None
                for k, v in trainer.model.state_dict().items():
                    if "running" not in k and "num_batches" not in k:
                        assert torch.equal(v, before[0][k]), k
                for k, v in trainer.ema.state_dict().items():
                    assert torch.equal(v, before[1][k]), k
        with HostSyncs() as py:
            trainer.train_step.check()
        assert py.seen == ["tolist"]   # the counters are read where asked, in one read
        assert trainer.progress.nonfinite_total == 1
        assert int(trainer.ema.n_averaged) == 3   # 4 steps, one skipped
    finally:
        trainer.close()


def test_the_divergence_stop_names_the_step_where_it_happened_and_waits_for_a_logging_step(tmp_path, monkeypatch):
    monkeypatch.setenv("LARGEBATCH_FAULTS", "nan@0:1-99")
    trainer = _trainer(tmp_path, "train.max_nonfinite=2", "train.log_every=5", "train.max_steps=12",
                       "data.synthetic_size=512")   # 16 steps an epoch: the epoch end is no logging step here
    try:
        with pytest.raises(UserError, match="3 consecutive steps with non-finite loss or gradients at step 3;"):
            trainer.fit()
        assert trainer.step == 5   # read at the first logging step after it
        # the run's status, for a study and any reader: diverged, with the sentence and where it stopped
        summary = json.loads((trainer.run_dir / "summary.json").read_text())
        assert summary["status"] == "diverged" and summary["steps"] == 5 and "final_top1" not in summary
        assert summary["reason"].startswith("training diverged: 3 consecutive steps")
    finally:
        trainer.close()


# ------------------------------------------------------------------------------------------- optimizers
def _schedule(steps: int = 30, peak: float = 0.4, warmup: int = 5) -> list[float]:
    """Linear warm-up, then poly-2 decay to 0: every step changes the lr (the momentum correction applies)."""
    return [peak * (t + 1) / warmup if t < warmup else peak * (1 - (t - warmup) / (steps - warmup)) ** 2
            for t in range(steps)]


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(6, 4, generator=g), torch.randn(3, 3, 2, 2, generator=g), torch.randn(5, generator=g)]
    grads = [[torch.randn(w.shape, generator=g) for w in weights] for _ in range(30)]
    return weights, grads


OPTIMIZERS = {
    "lars": lambda groups: LARS(groups, lr=0.0, momentum=0.9, weight_decay=5e-4, trust_coefficient=0.02,
                                nesterov=True),
    "lars-plain": lambda groups: LARS(groups, lr=0.0, momentum=0.9, weight_decay=5e-4, trust_coefficient=0.02),
    "lamb": lambda groups: LAMB(groups, lr=0.0, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01),
    "sgd": lambda groups: SGD(groups, lr=0.0, momentum=0.9, nesterov=True, weight_decay=5e-4),
}


def _train(name: str, dtype: torch.dtype, *, device_lr: bool, flag: bool, skip: set[int] = frozenset()):
    """30 steps of the schedule. device_lr: the groups' lr is a 0-dim tensor filled each step (a CUDA graph's
    form); flag: the step gets a found_inf tensor (0, or 1 with NaN gradients at the steps in `skip`); without
    it a skipped step is simply not taken (today's form)."""
    weights, grads = _problem()
    params = [w.to(dtype).clone().requires_grad_() for w in weights]
    opt = OPTIMIZERS[name]([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0, "lars_exclude": True}])
    if device_lr:
        for group in opt.param_groups:
            group["lr"] = torch.zeros((), dtype=torch.float64)
    for t, lr in enumerate(_schedule()):
        bad = t in skip
        for p, g in zip(params, grads[t]):
            p.grad = torch.full_like(p, float("nan")) if bad else g.to(dtype).clone()
        for group in opt.param_groups:
            if device_lr:
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        if flag:
            opt.found_inf = torch.tensor(1.0 if bad else 0.0)
            opt.step()
            del opt.found_inf
        elif not bad:
            opt.step()
    return [p.detach().clone() for p in params], opt


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_device_lr_and_skip_flag_equal_todays_update_over_30_steps(name, dtype):
    today, _ = _train(name, dtype, device_lr=False, flag=False)
    graphed, _ = _train(name, dtype, device_lr=True, flag=True)
    for a, b in zip(today, graphed):
        assert torch.equal(a, b), (a - b).abs().max()
    # a step skipped on the device is a step never taken: the same weights, the momentum correction's lr_old
    # and LAMB's step count kept as they were
    skip = {0, 7, 8, 20}
    today, opt_a = _train(name, dtype, device_lr=False, flag=False, skip=skip)
    graphed, opt_b = _train(name, dtype, device_lr=True, flag=True, skip=skip)
    for a, b in zip(today, graphed):
        assert torch.isfinite(b).all() and torch.equal(a, b), (a - b).abs().max()
    for sa, sb in zip(opt_a.state.values(), opt_b.state.values()):
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k], dtype=torch.float64), torch.as_tensor(sb[k], dtype=torch.float64)), k


def test_lars_over_30_steps_matches_algorithm_1_written_out():
    """The same 30-step schedule against You et al.'s Algorithm 1 with Goyal's momentum correction, per tensor
    in numpy (float64), with the device lr and flag."""
    weights, grads = _problem()
    got, _ = _train("lars-plain", torch.float64, device_lr=True, flag=True)
    lrs = _schedule()
    ws = [w.double().numpy().copy() for w in weights]
    vs = [np.zeros_like(w) for w in ws]
    for t, lr in enumerate(lrs):
        c = lr / lrs[t - 1] if t > 0 else 1.0
        for i, w in enumerate(ws):
            g = grads[t][i].double().numpy()
            exclude = i == 2
            wd = 0.0 if exclude else 5e-4
            wn, gn = np.linalg.norm(w), np.linalg.norm(g)
            lam = 1.0 if exclude else 0.02 * wn / (gn + wd * wn)
            vs[i] = 0.9 * c * vs[i] + lr * lam * (g + wd * w)
            ws[i] = w - vs[i]
    for a, b in zip(got, ws):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-10, atol=1e-12)


def test_the_device_ema_equals_averaged_model_and_skips_with_the_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    ours = build_ema(model, 0.9)
    theirs = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    for t in range(6):
        model(torch.randn(5, 3, 8, 8))   # moves the BN statistics and batch count
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        if t == 3:   # skipped: nothing moves, the count included
            snapshot = copy.deepcopy(ours.state_dict())
            update_ema(ours, model, torch.zeros((), dtype=torch.float64))
            for k, v in ours.state_dict().items():
                assert torch.equal(v, snapshot[k]), k
            continue
        update_ema(ours, model, torch.ones((), dtype=torch.float64))
        theirs.update_parameters(model)
    for (k, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), k


def test_where_a_cuda_graph_applies_and_the_sentences_where_it_does_not():
    from largebatch import graph

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert graph.plan("auto", cpu, 1, False) == (False, None)   # nothing to say on CPU
    assert graph.plan("off", cuda, 4, True) == (False, None)
    assert graph.plan("on", cuda, 1, False) == (True, None)   # auto: tests/unit/test_graph_harness.py
    assert graph.plan("auto", cuda, 2, False) == (False, "capture across processes (DDP) is not supported yet")
    assert graph.plan("auto", cuda, 1, True)[1].startswith("train.noise_scale")
    assert graph.plan("on", cuda, 1, False, "max-autotune-no-cudagraphs") == (True, None)   # captured inside
    assert graph.plan("auto", cuda, 1, False, "reduce-overhead") == (
        False, "torch.compile's mode reduce-overhead captures CUDA graphs of its own")
    with pytest.raises(UserError, match="train.compile_mode is reduce-overhead but train.compile is false"):
        config.load("fashion_mnist", ["train.compile_mode=reduce-overhead"])
    for device, world, noise, why in ((cpu, 1, False, "need a CUDA device"), (cuda, 2, False, "DDP"),
                                      (cuda, 1, True, "noise_scale")):
        with pytest.raises(UserError, match=f"train.cuda_graph is on but .*{why}.*; set train.cuda_graph to auto or off."):
            graph.plan("on", device, world, noise)




def test_the_benches_step_is_the_products_and_equals_the_plain_loop_on_finite_steps_and_skips_a_nan_one():
    """`step.local_step` (the step of the benches, the calibration and the scripts) is a `TrainStep`: on finite
    batches it equals the plain PyTorch loop (mean cross-entropy, backward, SGD with momentum) bit for bit within
    float tolerance, with no host sync; a NaN batch leaves the weights as they were and is counted."""
    from largebatch.step import TrainStep, local_step

    torch.manual_seed(0)
    mine = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    plain = copy.deepcopy(mine)
    step = local_step(mine, SGD(mine.parameters(), lr=0.1, momentum=0.9, nesterov=True), device=torch.device("cpu"),
                      label_smoothing=0.1)
    assert isinstance(step.train_step, TrainStep)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    for i in range(5):
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        lr = 0.1 * (i + 1) / 5
        with HostSyncs() as seen:
            step([(x[:8], y[:8]), (x[8:], y[8:])], lr)   # two micro-batches: the loss is still / 16
        assert not seen.seen
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        nn.functional.cross_entropy(plain(x), y, label_smoothing=0.1).backward()
        opt.step()
    for a, b in zip(mine.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b)
    before = [p.clone() for p in mine.parameters()]
    step([(torch.full((4, 6), float("nan")), torch.zeros(4, dtype=torch.long))], 0.1)
    assert all(torch.equal(a, b) for a, b in zip(before, mine.parameters()))
    step.train_step.check()
    assert step.train_step.progress.nonfinite_total == 1
