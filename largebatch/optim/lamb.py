"""LAMB: layer-wise adaptive moments (You et al., "Large Batch Optimization for Deep Learning:
Training BERT in 76 minutes", arXiv 1904.00962, Algorithm 2).

For every parameter tensor w ("layer") with gradient g at step t (counted per tensor from 1),
lr gamma, moment coefficients beta1, beta2, weight decay lambda and epsilon, one step is:

1. m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2.
2. Bias correction (when bias_correction): m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t);
   otherwise m_hat = m, v_hat = v.
3. r = m_hat / (sqrt(v_hat) + eps);  u = r + lambda * w.
4. Trust ratio phi(||w||) / ||u|| with phi the identity, and 1 when ||w|| or ||u|| is 0
   (torch.where on device: no host sync).
5. w = w - gamma * ratio * u.

Parameter groups with "lars_exclude": True (BN parameters and biases) get the Adam update:
steps 1-3 without weight decay (u = r) and no trust ratio (w = w - gamma * r).

The step never reads a tensor value on the host, so a CUDA graph can hold it: t is a float64 0-dim
tensor per parameter on its device (the bias corrections are computed there in float64, as the Python
floats they replace), the lr a group's float or 0-dim device tensor, and a step is skipped on the device
when `found_inf` says so (largebatch.optim.skip): moments, t and weights stay as they were.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable, Optional, Union, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from largebatch.optim.skip import Spread, device_scalar, ok_flag, zero_bad_grads_


class LAMB(Optimizer):
    """LAMB (Algorithm 2 of You et al. 2019); see the module docstring."""

    def __init__(self, params: Union[Iterable[Tensor], Iterable[dict]], lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 bias_correction: bool = True) -> None:
        if not lr >= 0.0:
            raise ValueError(f"LAMB: lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"LAMB: betas must be two numbers in [0, 1), got {betas}")
        if not eps > 0.0:
            raise ValueError(f"LAMB: eps must be > 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"LAMB: weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, lars_exclude=False)
        super().__init__(params, defaults)
        self._spread = Spread()   # device scalars as multi-tensor operands (buffers on CUDA, not state)

    def _spread_at(self, where: tuple, name: str, like: list[Tensor], value: Tensor) -> list[Tensor]:
        return self._spread((*where, name), like, value)

    _step_supports_amp_scaling = True   # GradScaler hands its found_inf over instead of reading it on the host
    static_lr_dtype = torch.float64     # a CUDA graph's lr tensor (step.set_lr): the precision of a Python float

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, then t goes to its parameter's device as float64: torch moves every other state tensor
        there but keeps "step" where the checkpoint was loaded (the CPU, as checkpoints are mapped) for
        optimizers that are not "capturable", and a CPU t would then meet CUDA tensors in `step` (a host
        scalar each step; a value frozen at capture in a CUDA graph). A t kept as a Python int (older
        largebatch) becomes a tensor too."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            if "step" in state:
                t = state["step"]
                t = t if isinstance(t, Tensor) else torch.tensor(float(t), dtype=torch.float64)
                state["step"] = t.to(device=p.device, dtype=torch.float64)

    @torch.no_grad()   # ignore: torch types the closure as returning a float; ours returns the loss tensor
    def step(self, closure: Optional[Callable[[], Tensor]] = None) -> Optional[Tensor]:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            params, grads, ms, vs, ts = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float64, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                ms.append(state["exp_avg"])
                vs.append(state["exp_avg_sq"])
                ts.append(state["step"])
            if not params:
                continue
            device = params[0].device
            ok = ok_flag(self, device)
            lr = device_scalar(group["lr"], device)
            if ok is None:
                torch._foreach_add_(ts, 1.0)
            else:
                zero_bad_grads_(grads, ok)
                torch._foreach_add_(ts, [ok] * len(ts))
            # 2. Bias corrections 1 / (1 - beta1^t) and 1 / sqrt(1 - beta2^t) per tensor, in float64.
            t = torch.stack(ts).clamp(min=1.0)   # t = 0 only at a first step skipped: its (unused) corrections finite
            if group["bias_correction"]:
                bc1, bc2 = 1.0 / (1.0 - torch.pow(beta1, t)), torch.rsqrt(1.0 - torch.pow(beta2, t))
            else:
                bc1 = bc2 = torch.ones_like(t)
            buckets = self._group_tensors_by_device_and_dtype([params, grads, ms, vs], with_indices=True)
            for bucket, (tensors, idx) in buckets.items():   # typed as lists of optional tensors; these hold none
                ps, gs, ms_, vs_ = (cast(list[Tensor], ts) for ts in tensors)
                dtype = ps[0].dtype
                if len(buckets) == 1:   # one conversion of each vector, not one per tensor
                    bc1s, bc2s = list(bc1.to(dtype).unbind(0)), list(bc2.to(dtype).unbind(0))
                else:
                    bc1s, bc2s = [bc1[j].to(dtype) for j in idx], [bc2[j].to(dtype) for j in idx]
                _lamb_update(ps, gs, ms_, vs_, bc1s, bc2s, ok=ok, lr=lr, beta1=beta1, beta2=beta2,
                             eps=group["eps"], weight_decay=group["weight_decay"], exclude=group["lars_exclude"],
                             spread=functools.partial(self._spread_at, (i, bucket)))
        return loss


def _lamb_update(ps: list[Tensor], gs: list[Tensor], ms: list[Tensor], vs: list[Tensor], bc1: list[Tensor],
                 bc2: list[Tensor], *,
                 ok: Optional[Tensor], lr: Tensor, beta1: float, beta2: float, eps: float, weight_decay: float,
                 exclude: bool, spread: Callable[[str, list[Tensor], Tensor], list[Tensor]]) -> None:
    """Steps 1-5 for tensors of one device and dtype; one temporary list (u). On a skipped step (ok 0,
    gradients cleared) the moments are kept by coefficients 1 and 0 and the weights by a zero lr. A scalar shared
    by every tensor is `spread` (largebatch.optim.skip.Spread: one multi-tensor kernel on CUDA); the per-tensor
    bias corrections and trust ratios take one kernel per tensor (torch has no multi-tensor form for a list of
    device scalars)."""
    dtype = ps[0].dtype
    # 1. Moments: m = m + (1 - beta1) (g - m), v = beta2 v + (1 - beta2) g^2; kept when skipped (the
    # cleared gradient adds nothing to v).
    if ok is None:
        torch._foreach_lerp_(ms, gs, 1.0 - beta1)
        torch._foreach_mul_(vs, beta2)
    else:
        torch._foreach_lerp_(ms, gs, spread("beta1", ms, ok * (1.0 - beta1)))
        torch._foreach_mul_(vs, torch.where(ok > 0, torch.full_like(ok, beta2), torch.ones_like(ok)).to(dtype))
        lr = lr * ok
    torch._foreach_addcmul_(vs, gs, gs, value=1.0 - beta2)
    # 2.-3. u = (m * bc1) / (sqrt(v) * bc2 + eps) + lambda * w, built in place in one new list.
    u = torch._foreach_sqrt(vs)
    torch._foreach_mul_(u, bc2)
    torch._foreach_add_(u, eps)
    torch._foreach_reciprocal_(u)
    torch._foreach_mul_(u, ms)
    torch._foreach_mul_(u, bc1)
    lr_ = lr.to(dtype)
    if exclude:
        # Adam update: no weight decay, no trust ratio.
        torch._foreach_addcmul_(ps, u, spread("neg_lr", ps, -lr_))
        return
    if weight_decay != 0:
        torch._foreach_add_(u, ps, alpha=weight_decay)
    # 4. Trust ratio ||w|| / ||u||, 1 where either norm is 0.
    w_norm = torch.stack(torch._foreach_norm(ps))
    u_norm = torch.stack(torch._foreach_norm(u))
    ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
    # 5. w = w - gamma * ratio * u.
    torch._foreach_addcmul_(ps, u, list((-lr_ * ratio).unbind(0)))
