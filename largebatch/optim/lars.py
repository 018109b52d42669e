"""LARS: layer-wise adaptive rate scaling (You, Gitman, Ginsburg, "Large Batch Training of
Convolutional Networks", arXiv 1708.03888, Algorithm 1), with Goyal et al.'s momentum correction.

For every parameter tensor w ("layer") with gradient g, global lr gamma (set by the schedule),
momentum m, weight decay beta, trust coefficient eta, one step is:

1. Momentum correction (Goyal et al., arXiv 1706.02677, section 2.1): the lr lives inside the
   velocity v, so when the group lr changed since the previous step, v <- (lr_new / lr_old) * v
   (folded into the momentum factor of step 4; skipped when lr_old is 0). lr_old is kept in the
   parameter group as "prev_lr", so it travels with state_dict()/load_state_dict().
2. Norms: ||w|| and ||g|| of every tensor, computed with one foreach kernel each.
3. Local lr: lambda = eta * ||w|| / (||g|| + beta * ||w|| + eps), and lambda = 1 when ||w|| or
   ||g|| is 0 (torch.where on device: no host sync, no Python branch on a tensor value).
4. v = m * v + gamma * lambda * (g + beta * w).
5. w = w - v; with Nesterov, w = w - (m * v + gamma * lambda * (g + beta * w)).

Parameter groups with "lars_exclude": True (BN parameters and biases, see
largebatch.optim.param_groups) skip step 3 (lambda = 1): plain momentum SGD in the same v form,
v = m * v + gamma * (g + beta * w), with the group's own weight decay (0 from param_groups).

The step is a fixed sequence of torch._foreach_* kernels per (device, dtype) bucket; it never
reads a tensor value on the host.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Union, cast

import torch
from torch import Tensor
from torch.optim import Optimizer


class LARS(Optimizer):
    """LARS (Algorithm 1 of You et al.) with momentum correction; see the module docstring."""

    def __init__(self, params: Union[Iterable[Tensor], Iterable[dict]], lr: float, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001, eps: float = 0.0,
                 nesterov: bool = False) -> None:
        if not lr >= 0.0:
            raise ValueError(f"LARS: lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"LARS: momentum must be in [0, 1), got {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"LARS: weight_decay must be >= 0, got {weight_decay}")
        if not trust_coefficient > 0.0:
            raise ValueError(f"LARS: trust_coefficient must be > 0, got {trust_coefficient}")
        if not eps >= 0.0:
            raise ValueError(f"LARS: eps must be >= 0, got {eps}")
        if nesterov and momentum == 0.0:
            raise ValueError("LARS: nesterov needs momentum > 0")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, nesterov=nesterov, lars_exclude=False)
        super().__init__(params, defaults)

    @torch.no_grad()   # ignore: torch types the closure as returning a float; ours returns the loss tensor
    def step(self, closure: Optional[Callable[[], Tensor]] = None) -> Optional[Tensor]:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LARS does not support sparse gradients")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                bufs.append(state["momentum_buffer"])
            lr, m = group["lr"], group["momentum"]
            # 1. Momentum correction: scale v by lr_new / lr_old (Python floats: no host sync).
            prev_lr = group.get("prev_lr", lr)
            correction = lr / prev_lr if prev_lr != 0 else 1.0
            group["prev_lr"] = lr
            if not params:
                continue
            buckets = self._group_tensors_by_device_and_dtype([params, grads, bufs])
            for tensors, _ in buckets.values():   # typed as lists of optional tensors; these hold none
                ps, gs, vs = (cast(list[Tensor], ts) for ts in tensors)
                _lars_update(ps, gs, vs, lr=lr, momentum=m, correction=correction, weight_decay=group["weight_decay"],
                             eta=group["trust_coefficient"], eps=group["eps"], nesterov=group["nesterov"],
                             exclude=group["lars_exclude"])
        return loss


def _lars_update(ps: list[Tensor], gs: list[Tensor], vs: list[Tensor], *, lr: float, momentum: float,
                 correction: float, weight_decay: float, eta: float, eps: float, nesterov: bool,
                 exclude: bool) -> None:
    """Steps 2-5 for tensors of one device and dtype, in place: no temporary copy of the model.

    With s = gamma * lambda the update is expanded so that every kernel works in place
    (an out-of-place temporary of 100 MB costs more in page faults than the arithmetic on CPU):
    v = (m c) v + s g + (s beta) w;  w -= v, or with Nesterov w = (1 - s beta) w - s g - m v.
    """
    wd = weight_decay
    if exclude:
        s: Union[float, list[Tensor]] = lr
        sb: Union[float, list[Tensor]] = lr * wd
        keep: Union[float, list[Tensor]] = 1.0 - lr * wd
        neg_s: Union[float, list[Tensor]] = -lr
    else:
        # 2. Per-tensor norms, stacked into one vector each.
        w_norm = torch.stack(torch._foreach_norm(ps))
        g_norm = torch.stack(torch._foreach_norm(gs))
        # 3. lambda, 1 where either norm is 0; all on device. s = gamma * lambda per tensor.
        trust = eta * w_norm / (g_norm + wd * w_norm + eps)
        s_vec = torch.where((w_norm > 0) & (g_norm > 0), trust, torch.ones_like(trust)) * lr
        s, sb = list(s_vec.unbind(0)), list((s_vec * wd).unbind(0))
        keep, neg_s = list((1.0 - s_vec * wd).unbind(0)), list((-s_vec).unbind(0))
    # 4. v = (m c) v + s g + (s beta) w.
    torch._foreach_mul_(vs, momentum * correction)
    _add_scaled_(vs, gs, s)
    if wd != 0:
        _add_scaled_(vs, ps, sb)
    # 5. w = w - v, or w = w - (m v + s (g + beta w)) = (1 - s beta) w - s g - m v.
    if nesterov:
        if wd != 0:
            torch._foreach_mul_(ps, keep)
        _add_scaled_(ps, gs, neg_s)
        torch._foreach_add_(ps, vs, alpha=-momentum)
    else:
        torch._foreach_sub_(ps, vs)


def _add_scaled_(out: list[Tensor], xs: list[Tensor], scale: Union[float, list[Tensor]]) -> None:
    """out[i] += scale[i] * xs[i], for one float or one 0-dim tensor per entry."""
    if isinstance(scale, list):
        torch._foreach_addcmul_(out, xs, scale)
    else:
        torch._foreach_add_(out, xs, alpha=scale)
