"""Optimisers of largebatch: momentum SGD (torch's), LARS and LAMB, with parameter groups chosen by shape.

`build_optimizer(cfg.optim, model, lr)` is the one entry point. Parameters with ndim <= 1 (BN gamma and
beta, every bias, including the BN of shortcut branches) go in a group with no weight decay and
"lars_exclude": True, so LARS/LAMB give them no layer-wise adaptation (Goyal et al.; You et al.).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.optim import Optimizer

from largebatch.config import OptimConfig
from largebatch.errors import UserError
from largebatch.optim.ema import build_ema, update_ema
from largebatch.optim.lamb import LAMB
from largebatch.optim.lars import LARS
from largebatch.optim.sgd import SGD

OPTIMIZERS = ("sgd", "lars", "lamb")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups, by shape (not by name): weights (ndim >= 2) with `weight_decay`, and BN/bias
    parameters (ndim <= 1) with no weight decay and "lars_exclude": True. Empty groups are left out;
    parameters that do not require gradients are skipped."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0, "lars_exclude": True}]
    return [g for g in groups if g["params"]]


def build_optimizer(cfg: OptimConfig, model: nn.Module, lr: float) -> Optimizer:
    """The optimizer `cfg.name` over `model`'s parameters, starting at `lr` (the schedule sets it later).

    With cfg.no_decay_bn_bias the groups come from `param_groups`; without it, one group where every
    parameter gets weight decay (and, for LARS/LAMB, the layer-wise adaptation).
    """
    if cfg.no_decay_bn_bias:
        groups = param_groups(model, cfg.weight_decay)
    else:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": cfg.weight_decay}]
    if not any(g["params"] for g in groups):
        raise UserError("the model has no trainable parameters; check the model and any frozen layers.")
    if cfg.name == "sgd":
        if cfg.nesterov and cfg.momentum == 0:
            raise UserError("optim.nesterov needs optim.momentum > 0; set a momentum (e.g. 0.9) or nesterov: false.")
        # torch's SGD, fused (largebatch/optim/sgd.py: the momentum correction is built in)
        return SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
    if cfg.name == "lars":
        if cfg.nesterov and cfg.momentum == 0:
            raise UserError("optim.nesterov needs optim.momentum > 0; set a momentum (e.g. 0.9) or nesterov: false.")
        if cfg.trust_coefficient <= 0 or cfg.lars_eps < 0:
            raise UserError(f"LARS needs optim.trust_coefficient > 0 and optim.lars_eps >= 0, got "
                            f"{cfg.trust_coefficient} and {cfg.lars_eps}; fix them in the recipe.")
        return LARS(groups, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                    trust_coefficient=cfg.trust_coefficient, eps=cfg.lars_eps, nesterov=cfg.nesterov)
    if cfg.name == "lamb":
        eps = cfg.lamb_eps
        betas = tuple(cfg.betas)
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise UserError(f"optim.betas is {cfg.betas}; give two numbers in [0, 1), e.g. [0.9, 0.999].")
        return LAMB(groups, lr=lr, betas=betas, eps=eps, weight_decay=cfg.weight_decay)
    raise UserError(f"unknown optimizer {cfg.name!r}; choose one of: {', '.join(OPTIMIZERS)} (optim.name).")


__all__ = ["SGD", "LARS", "LAMB", "OPTIMIZERS", "param_groups", "build_optimizer", "build_ema", "update_ema",
           "zero_grads"]


def zero_grads(optimizer: Optimizer) -> None:
    """Every gradient of `optimizer` zeroed in place, in one multi-tensor call (`torch._foreach_zero_`), where
    `optimizer.zero_grad(set_to_none=False)` launches a kernel per gradient unless the optimizer was built with
    foreach or fused (LARS and LAMB are not): the tensors stay where a CUDA graph or DDP's buckets have them."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    for g in grads:
        if g.grad_fn is not None:   # as zero_grad does: a gradient that is itself part of a graph
            g.detach_()
        else:
            g.requires_grad_(False)
    if grads:
        torch._foreach_zero_(grads)
