"""One step of a point-to-point algorithm: send one message and receive one, concurrently.

1. Post the receive first, then the send, so that both are in flight together
   (a ring of ranks that all send first cannot deadlock on gloo, whose ``isend``
   does not wait for the peer, but the early receive lets the transport land the
   data straight in place).
2. gloo (CPU): plain ``dist.irecv`` / ``dist.isend``. ``batch_isend_irecv`` adds
   its coalescing manager's fixed cost to every step on gloo, and the p2p
   algorithms are latency-bound below a few MB, so that cost would dominate.
3. Any other backend (NCCL): ``batch_isend_irecv``, which NCCL runs inside one
   ncclGroupStart/End; that is what keeps a ring of blocking pairs from
   deadlocking there.
4. Wait for both. On NCCL ``wait()`` only makes the current stream wait, so the
   host does not block.

Peers are global ranks; ``group`` is the (sub-)group whose communicator carries
the messages. Empty messages are skipped on both sides: the two ends agree because
they compute the same chunk offsets.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

def exchange(send: Optional[torch.Tensor], dst: int, recv: Optional[torch.Tensor], src: int,
             group: Optional[dist.ProcessGroup]) -> None:
    """Send ``send`` to global rank ``dst`` while receiving ``recv`` from global rank ``src`` (steps 1-4)."""
    recv = recv if recv is not None and recv.numel() > 0 else None
    send = send if send is not None and send.numel() > 0 else None
    if recv is None and send is None:
        return
    if dist.get_backend(group) == "gloo":                                  # 2. (~3 us lookup)
        if (recv is not None and recv.is_cuda) or (send is not None and send.is_cuda):
            _exchange_staged(send, dst, recv, src, group)
            return
        rw = dist.irecv(recv, src, group) if recv is not None else None   # 1. receive first
        sw = dist.isend(send, dst, group) if send is not None else None
        if rw is not None:                                                # 4.
            rw.wait()
        if sw is not None:
            sw.wait()
        return
    ops = []                                                              # 3.
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, src, group))
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, dst, group))
    for work in dist.batch_isend_irecv(ops):                              # 4.
        work.wait()


def _exchange_staged(send: Optional[torch.Tensor], dst: int, recv: Optional[torch.Tensor], src: int,
                     group: Optional[dist.ProcessGroup]) -> None:
    """Step 2 for CUDA tensors on gloo, whose send/recv take host memory only: through host copies
    (several processes sharing one GPU, or a gloo group on GPUs; NCCL takes the tensors as they are)."""
    host_recv = torch.empty(recv.shape, dtype=recv.dtype, pin_memory=True) if recv is not None else None
    host_send = send.to("cpu") if send is not None else None
    rw = dist.irecv(host_recv, src, group) if host_recv is not None else None
    sw = dist.isend(host_send, dst, group) if host_send is not None else None
    if rw is not None:
        rw.wait()
        assert recv is not None and host_recv is not None   # rw is the receive into host_recv
        recv.copy_(host_recv)
    if sw is not None:
        sw.wait()
