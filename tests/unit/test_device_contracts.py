"""What the step on CUDA relies on, checked on CPU: after a resume from a checkpoint loaded to the CPU (as
`checkpoint.load` maps it), every tensor that `optimizer.step()`, `update_ema` and `TrainStep.apply` touch is on
the parameters' device. The `meta` device stands in for CUDA: torch moves optimizer state to the parameters'
device on load except what it keeps on the CPU on purpose (the "step" of a non-capturable optimizer), and a
dispatch mode refuses any CPU tensor in those calls. (On CUDA a 0-dim CPU tensor is accepted by most ops as a
host scalar: a host read each step, and inside a CUDA graph a value frozen at capture; so a CPU tensor there is a
defect even where it does not raise.) Also the dtypes a graph's static tensors keep.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from largebatch import checkpoint, config
from largebatch.optim import build_ema, build_optimizer
from largebatch.progress import Progress
from largebatch.step import TrainStep, set_lr

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*to a meta parameter")]   # meta weights: no values to copy
META = torch.device("meta")


class OnlyOn(TorchDispatchMode):
    """Raises at the first op that reads or writes a tensor on another device than `device`."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device, self.ops = device, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(t, torch.Tensor) and t.device != self.device:
                raise AssertionError(f"{func} got a tensor on {t.device} (shape {tuple(t.shape)}) in a step on "
                                     f"{self.device}")
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _Faults:
    def poison(self, step):
        return False


def _checkpointed(tmp_path, optim: str):
    """A CPU run of 3 steps with an EMA, saved and loaded back as a resume loads it (to the CPU)."""
    from largebatch.trainer import Trainer

    cfg = config.load("fashion_mnist", [
        "model.width=4", "data.dataset=synthetic", "data.synthetic_size=64", "data.image_size=12",
        "batch.global_batch=16", "train.plots=false", "train.max_steps=3", "train.ema=0.9", f"optim.name={optim}"])
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    trainer.fit()
    path = trainer.state.save(3, 0.75, 1.0)
    model = copy.deepcopy(trainer.model)
    trainer.close()
    return cfg, model, checkpoint.load(path)


@pytest.mark.parametrize("optim", ["lars", "lamb"])   # torch's fused SGD refuses meta tensors; it keeps no step
def test_after_a_cpu_mapped_resume_the_step_touches_only_the_parameters_device(tmp_path, optim):
    cfg, model, state = _checkpointed(tmp_path, optim)
    model = model.to(META)
    optimizer = build_optimizer(cfg.optim, model, lr=0.1)
    ema = build_ema(model, cfg.train.ema)
    assert ema is not None
    checkpoint.restore(model, state["model"], "model", tmp_path, "")
    checkpoint.restore(optimizer, state["optimizer"], "optimizer", tmp_path, "")
    checkpoint.restore(ema, state["ema"], "EMA model", tmp_path, "")
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    ts = TrainStep(model=model, ddp=model, forward=model, optimizer=optimizer, scaler=scaler, ema=ema, noise=None,
                   faults=_Faults(), device=META, world_size=1, precision="fp32", channels_last=False,
                   label_smoothing=0.0, log_every=10, max_nonfinite=3, progress=Progress())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    set_lr(optimizer, 0.05, static=True)
    found_inf = torch.zeros((), device=META)
    with OnlyOn(META) as mode:
        for step in (3, 4):
            ts.apply(found_inf, step)
    assert mode.ops > 0
    for st in optimizer.state.values():   # and what they read stays there and keeps its dtype
        for k, v in st.items():
            assert v.device == META, k
            if k == "step":
                assert v.dtype == torch.float64 and v.dim() == 0


def test_the_dtypes_a_graph_keeps(tmp_path):
    """Static lrs: float64 where the optimizer computes in the precision of a Python float (LARS, LAMB), float32
    for torch's fused SGD; the verdict a float32 0-dim tensor; LAMB's step float64 after a load of a checkpoint
    written with a Python int (older largebatch)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    for name, want in (("sgd", torch.float32), ("lars", torch.float64), ("lamb", torch.float64)):
        opt = build_optimizer(config.OptimConfig(name=name, lr=0.1), model, lr=0.1)
        set_lr(opt, 0.2, static=True)
        assert all(g["lr"].dtype == want and g["lr"].dim() == 0 for g in opt.param_groups), name
    ts = TrainStep(model=model, ddp=model, forward=model, optimizer=opt, scaler=torch.amp.GradScaler("cuda", enabled=False),
                   ema=None, noise=None, faults=_Faults(), device=torch.device("cpu"), world_size=1, precision="fp32",
                   channels_last=False, label_smoothing=0.0, log_every=10, max_nonfinite=3, progress=Progress())
    model(torch.randn(5, 4)).sum().backward()
    verdict = ts.verdict()
    assert verdict.dtype == torch.float32 and verdict.dim() == 0 and float(verdict) == 0.0
    opt.step()
    sd = opt.state_dict()
    for st in sd["state"].values():
        st["step"] = 7   # as an older largebatch wrote it
    opt.load_state_dict(sd)
    assert all(st["step"].dtype == torch.float64 and float(st["step"]) == 7.0 for st in opt.state.values())
