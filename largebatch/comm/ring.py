"""Ring all-reduce: bandwidth-optimal reduce-scatter then all-gather over point-to-point.

Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations" (JPDC 2009); the algorithm of Baidu's ring all-reduce and of NCCL's
ring. ``p`` ranks in a ring ``R[0] -> R[1] -> ... -> R[p-1] -> R[0]``; rank ``i``
sends to ``R[i+1]`` and receives from ``R[i-1]``.

1. Split the flat tensor of ``n`` elements into ``p`` near-equal chunks (any ``n``,
   any ``p``; chunks may be empty when ``n < p``).
2. Reduce-scatter, ``p - 1`` steps: at step ``s`` rank ``i`` sends chunk
   ``(i - s) mod p`` and, at the same time, receives chunk ``(i - s - 1) mod p``,
   which it adds in place (``add_``) into its own copy of that chunk.
   After the last step rank ``i`` holds the full sum of chunk ``(i + 1) mod p``.
3. The owner rounds its chunk through the wire format (lossy compression only), so
   that all ranks end bit-identical.
4. All-gather, ``p - 1`` steps: at step ``s`` rank ``i`` sends chunk
   ``(i + 1 - s) mod p`` and receives chunk ``(i - s) mod p`` straight into the
   tensor (no copy when uncompressed).

Cost (alpha-beta): ``2(p-1) alpha + 2(p-1)/p n beta``: every rank sends and
receives ``2(p-1)/p`` of the tensor, the minimum for an all-reduce.
The phases are public so that `torus2d` and `hierarchical` run them on rows/nodes.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from largebatch.comm.chunking import bounds, scratch
from largebatch.comm.compression import Codec
from largebatch.comm.p2p import exchange


def owned_chunk(i: int, p: int) -> int:
    """The chunk that ring position ``i`` holds fully reduced after `reduce_scatter`."""
    return (i + 1) % p


def reduce_scatter(flat: torch.Tensor, ranks: list[int], i: int, group: Optional[dist.ProcessGroup],
                   codec: Codec) -> list[int]:
    """Steps 1-3 on ``flat`` among global ``ranks`` (this process is ``ranks[i]``); returns the chunk offsets."""
    p = len(ranks)
    off = bounds(flat.numel(), p)                                     # step 1
    if p == 1:
        return off
    nxt, prv = ranks[(i + 1) % p], ranks[(i - 1) % p]
    biggest = off[1] - off[0]
    wdt = codec.wire_dtype(flat.dtype)
    recv_buf = scratch(biggest, wdt, flat.device, slot=0)
    send_buf = scratch(biggest, wdt, flat.device, slot=1) if codec.lossy else None
    for s in range(p - 1):                                            # step 2
        cs, cr = (i - s) % p, (i - s - 1) % p
        send = flat[off[cs]:off[cs + 1]]
        dst = flat[off[cr]:off[cr + 1]]
        recv = recv_buf[:dst.numel()]
        exchange(send if send_buf is None else codec.encode(send, send_buf[:send.numel()]), nxt, recv, prv, group)
        dst.add_(recv)
    own = owned_chunk(i, p)                                           # step 3
    codec.round_(flat[off[own]:off[own + 1]])
    return off


def all_gather(flat: torch.Tensor, off: list[int], ranks: list[int], i: int,
               group: Optional[dist.ProcessGroup], codec: Codec) -> None:
    """Step 4: every rank starts with its `owned_chunk` of ``flat`` reduced and ends with all chunks."""
    p = len(ranks)
    if p == 1:
        return
    nxt, prv = ranks[(i + 1) % p], ranks[(i - 1) % p]
    biggest = off[1] - off[0]
    wdt = codec.wire_dtype(flat.dtype)
    if codec.lossy:
        recv_buf = scratch(biggest, wdt, flat.device, slot=0)
        send_buf = scratch(biggest, wdt, flat.device, slot=1)
    for s in range(p - 1):
        cs, cr = (i + 1 - s) % p, (i - s) % p
        send = flat[off[cs]:off[cs + 1]]
        dst = flat[off[cr]:off[cr + 1]]
        if not codec.lossy:
            exchange(send, nxt, dst, prv, group)                      # straight into place
        else:
            recv = recv_buf[:dst.numel()]
            exchange(codec.encode(send, send_buf[:send.numel()]), nxt, recv, prv, group)
            dst.copy_(recv)


def allreduce(flat: torch.Tensor, ranks: list[int], i: int, group: Optional[dist.ProcessGroup],
              codec: Codec) -> None:
    """Sum ``flat`` in place over the ring ``ranks`` (steps 1-4)."""
    off = reduce_scatter(flat, ranks, i, group, codec)
    all_gather(flat, off, ranks, i, group, codec)
