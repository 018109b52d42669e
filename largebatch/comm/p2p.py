"""One step of a point-to-point algorithm: send one message and receive one, concurrently.

`exchange` posts the send and the receive together with ``batch_isend_irecv``
(gloo on CPU runs them as concurrent isend/irecv; NCCL groups them in one
ncclGroupStart/End, which is what keeps a ring of blocking pairs from deadlocking)
and waits for both. Peers are global ranks; ``group`` is the (sub-)group whose
communicator carries the messages. Empty messages are skipped on both sides: the
two ends agree because they compute the same chunk offsets. On NCCL ``wait()``
only makes the current stream wait, so the host does not block.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def exchange(send: Optional[torch.Tensor], dst: int, recv: Optional[torch.Tensor], src: int,
             group: Optional[dist.ProcessGroup]) -> None:
    """Send ``send`` to global rank ``dst`` while receiving ``recv`` from global rank ``src``."""
    ops = []
    if recv is not None and recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, src, group))
    if send is not None and send.numel():
        ops.append(dist.P2POp(dist.isend, send, dst, group))
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()
