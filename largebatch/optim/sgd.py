"""Momentum SGD: torch's, fused, so that a step is skipped on the device (largebatch.optim.skip).

torch keeps v = m v + g and steps w -= lr v: lr sits outside v, so a change of lr applies to the whole
velocity at once, which is exactly Goyal's momentum correction (v <- (lr_new/lr_old) v in the lr-inside
form). Extra group keys ("lars_exclude") are ignored.

Only torch's fused kernel reads `found_inf` (its foreach form asserts there is none), so this class keeps it
fused through a checkpoint written by a foreach SGD (the form is not state). The momentum buffers start as
zeros, not at the first step: a fused step skipped at step 1 would otherwise leave them uninitialised, and
m * 0 + g is the first step's v anyway.
"""
from __future__ import annotations

import torch


class SGD(torch.optim.SGD):
    def __init__(self, params, lr: float, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0):
        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, fused=True)
        self._init_buffers()

    def _init_buffers(self) -> None:
        for group in self.param_groups:
            if group["momentum"] == 0:
                continue
            for p in group["params"]:
                if self.state[p].get("momentum_buffer") is None:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["fused"], group["foreach"] = True, False
        self._init_buffers()
