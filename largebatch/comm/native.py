"""The backend's own all-reduce (gloo on CPU, NCCL on GPU): the baseline.

1. Lossless: ``dist.all_reduce(flat, SUM)`` in place.
2. Compressed: cast the (pre-scaled) tensor to the wire dtype, all-reduce that
   copy, and copy the result back. Here the *backend* accumulates, in the wire
   dtype: this is exactly PyTorch's ``fp16_compress_hook``, kept as the baseline
   for the compressed p2p algorithms, which accumulate in the tensor's dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from largebatch.comm.compression import Codec


def allreduce(flat: torch.Tensor, ranks: list[int], i: int, group: Optional[dist.ProcessGroup],
              codec: Codec) -> None:
    """Sum ``flat`` in place over ``group`` (``ranks``/``i`` only for the common signature)."""
    if len(ranks) == 1:
        return
    if not codec.lossy:                                                # 1.
        dist.all_reduce(flat, group=group)
        return
    wire = flat.to(codec.wire)                                         # 2.
    dist.all_reduce(wire, group=group)
    flat.copy_(wire)
