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
reads a tensor value on the host, so a CUDA graph can hold it:
- the lr is a group's "lr", a float or a 0-dim device tensor (a graph's static lr, filled before each
  replay); lr_old and the correction live on the device (float64, as the floats they replace);
- a step is skipped on the device when `found_inf` says so (largebatch.optim.skip): nothing changes,
  lr_old included, as when the step was never called.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable, Optional, Union, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from largebatch.optim.skip import Spread, device_scalar, ok_flag, zero_bad_grads_


class LARS(Optimizer):
    """LARS (Algorithm 1 of You et al.) with momentum correction; see the module docstring."""

    _step_supports_amp_scaling = True   # GradScaler hands its found_inf over instead of reading it on the host
    static_lr_dtype = torch.float64     # a CUDA graph's lr tensor (step.set_lr): the precision of a Python float

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
        self._prev_lr: dict[int, Tensor] = {}   # group index -> lr_old on the device (float64)
        self._spread = Spread()   # device scalars as multi-tensor operands (buffers on CUDA, not state)

    def _spread_at(self, where: tuple, name: str, like: list[Tensor], value: Tensor) -> list[Tensor]:
        return self._spread((*where, name), like, value)

    def state_dict(self) -> dict:
        """As torch's, with each group's lr_old as the float "prev_lr" (a host read: checkpoints only)."""
        state = super().state_dict()
        for i, group in enumerate(state["param_groups"]):
            if i in self._prev_lr:
                group["prev_lr"] = float(self._prev_lr[i])
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._prev_lr = {}   # rebuilt from the groups' "prev_lr" at the next step

    @torch.no_grad()   # ignore: torch types the closure as returning a float; ours returns the loss tensor
    def step(self, closure: Optional[Callable[[], Tensor]] = None) -> Optional[Tensor]:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, group in enumerate(self.param_groups):
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
            if not params:
                continue
            device = params[0].device
            lr = device_scalar(group["lr"], device)
            if i not in self._prev_lr:   # the first step, or the first after a load: lr_old as the group kept it
                self._prev_lr[i] = device_scalar(group.get("prev_lr", group["lr"]), device).clone()
            prev = self._prev_lr[i]
            ok = ok_flag(self, device)
            # 1. Momentum correction lr_new / lr_old (1 when lr_old is 0), on the device; momentum factor 1 and
            # lr_old kept on a skipped step.
            factor = group["momentum"] * torch.where(prev != 0, lr / prev, torch.ones_like(lr))
            if ok is not None:
                factor = torch.where(ok > 0, factor, torch.ones_like(factor))
                prev.copy_(torch.where(ok > 0, lr, prev))
                zero_bad_grads_(grads, ok)
                lr = lr * ok
            else:
                prev.copy_(lr)
            buckets = self._group_tensors_by_device_and_dtype([params, grads, bufs])
            for bucket, (tensors, _) in buckets.items():   # typed as lists of optional tensors; these hold none
                ps, gs, vs = (cast(list[Tensor], ts) for ts in tensors)
                _lars_update(ps, gs, vs, lr=lr, factor=factor, ok=ok, momentum=group["momentum"],
                             spread=functools.partial(self._spread_at, (i, bucket)),
                             weight_decay=group["weight_decay"], eta=group["trust_coefficient"], eps=group["eps"],
                             nesterov=group["nesterov"], exclude=group["lars_exclude"])
        return loss


def _lars_update(ps: list[Tensor], gs: list[Tensor], vs: list[Tensor], *, lr: Tensor, factor: Tensor,
                 ok: Optional[Tensor], momentum: float, weight_decay: float, eta: float, eps: float, nesterov: bool,
                 exclude: bool, spread: Callable[[str, list[Tensor], Tensor], list[Tensor]]) -> None:
    """Steps 2-5 for tensors of one device and dtype, in place: no temporary copy of the model.

    With s = gamma * lambda the update is expanded so that every kernel works in place
    (an out-of-place temporary of 100 MB costs more in page faults than the arithmetic on CPU):
    v = (m c) v + s g + (s beta) w;  w -= v, or with Nesterov w = (1 - s beta) w - s g - m v.
    `lr` is 0 and `factor` 1 on a skipped step (gradients cleared), so v keeps its value; w then moves by
    ok * v (ok * m * v with Nesterov). A scalar shared by every tensor is `spread` (largebatch.optim.skip.Spread),
    so that its op stays one multi-tensor kernel on CUDA; the per-tensor s of step 3 takes one kernel per tensor
    (torch has no multi-tensor form for a list of device scalars).
    """
    wd, dtype, n = weight_decay, ps[0].dtype, len(ps)
    lr_ = lr.to(dtype)
    if exclude:
        s_vec = lr_.expand(n)
        s = spread("lr", gs, lr_)
    else:
        # 2. Per-tensor norms, stacked into one vector each.
        w_norm = torch.stack(torch._foreach_norm(ps))
        g_norm = torch.stack(torch._foreach_norm(gs))
        # 3. lambda, 1 where either norm is 0; all on device. s = gamma * lambda per tensor.
        trust = eta * w_norm / (g_norm + wd * w_norm + eps)
        s_vec = torch.where((w_norm > 0) & (g_norm > 0), trust, torch.ones_like(trust)) * lr_
        s = list(s_vec.unbind(0))
    # 4. v = (m c) v + s g + (s beta) w.
    torch._foreach_mul_(vs, factor.to(dtype))
    torch._foreach_addcmul_(vs, gs, s)
    if wd != 0:
        torch._foreach_addcmul_(vs, ps, list((s_vec * wd).unbind(0)))
    # 5. w = w - v, or w = w - (m v + s (g + beta w)) = (1 - s beta) w - s g - m v.
    ok_ = ok.to(dtype) if ok is not None else None
    if nesterov:
        if wd != 0:
            torch._foreach_mul_(ps, list((1.0 - s_vec * wd).unbind(0)))
        torch._foreach_addcmul_(ps, gs, spread("neg_lr", gs, -lr_) if exclude else list((-s_vec).unbind(0)))
        if ok_ is None:
            torch._foreach_add_(ps, vs, alpha=-momentum)
        else:
            torch._foreach_addcmul_(ps, vs, spread("step", ps, ok_ * -momentum))
    elif ok_ is None:
        torch._foreach_sub_(ps, vs)
    else:
        torch._foreach_addcmul_(ps, vs, spread("step", ps, -ok_))
