"""BatchNorm over a fixed number of images (`model.bn_batch`): ghost batch normalisation (Hoffer, Hubara, Soudry,
"Train longer, generalize better", arXiv 1705.08741), as Goyal et al. set it (section 2.3: BN statistics over
n = 32 images per worker, whatever the per-GPU batch) and MLPerf's ResNet-50 sets its BN span.

1. In training, a batch of N images is normalised in groups of `bn_batch` consecutive images (the last group
   takes the remainder): each group by its own mean and variance, exactly as a BatchNorm layer given that group
   alone; the affine weight and bias are shared.
2. The running statistics are updated once per group, in order, with the layer's momentum (each group is one
   BatchNorm forward pass, as in torch's and MLPerf's implementations).
3. In evaluation, and for batches of at most `bn_batch` images, the layer is torch's BatchNorm. The layer stays a
   `torch.nn.BatchNorm2d` (same parameters, buffers and state-dict names; chosen by shape as BN everywhere else).
"""
from __future__ import annotations

import torch
from torch import nn


class GhostBatchNorm2d(nn.BatchNorm2d):
    bn_batch: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.bn_batch
        if not self.training or n <= 0 or x.shape[0] <= n:
            return super().forward(x)
        return torch.cat([super(GhostBatchNorm2d, self).forward(chunk) for chunk in x.split(n)])


def apply_bn_batch(net: nn.Module, bn_batch: int) -> list[str]:
    """Step 3: every torch BatchNorm2d of `net` normalises groups of `bn_batch` images; the names of BN layers of
    other classes (a library's fused BN + activation), which are left as they are."""
    other = []
    for name, module in net.named_modules():
        if type(module) in (nn.BatchNorm2d, GhostBatchNorm2d):
            module.__class__ = GhostBatchNorm2d
            module.bn_batch = bn_batch
        elif isinstance(module, nn.modules.batchnorm._BatchNorm):
            other.append(f"{name} ({type(module).__name__})")
    return other
