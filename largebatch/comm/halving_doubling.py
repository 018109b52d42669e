"""Recursive halving and doubling all-reduce (Rabenseifner's algorithm), any world size.

Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
Operations in MPICH" (IJHPCA 2005), section 4.5; the inter-server all-reduce of
Goyal et al. (2017). ``p`` ranks ``R[0..p-1]``; ``p2`` is the largest power of two
<= ``p`` and ``r = p - p2`` ranks are extra.

1. Fold: of the first ``2r`` positions, each even position ``2k`` sends its whole
   tensor to the odd position ``2k+1``, which adds it in place and takes part as
   new rank ``k``; the even ones sit out. Positions ``>= 2r`` become new rank
   ``i - r``. Now exactly ``p2`` ranks hold partial sums that together cover all.
2. Split the tensor into ``p2`` near-equal blocks (any length works).
3. Recursive halving (reduce-scatter), ``log2 p2`` steps, distance ``d = 1, 2,
   ..., p2/2`` (nearest partner first, so the largest messages stay inside a
   node when ranks are numbered node by node): exchange with new rank ``k xor d``;
   the rank with bit ``d`` clear keeps the lower half of its current block range
   and sends the upper half, the other the reverse; both send and receive at once
   and ``add_`` the received half into the kept half. Each rank ends owning one
   block (block index = ``k`` bit-reversed).
4. The owner rounds its block through the wire format (lossy compression only).
5. Recursive doubling (all-gather), the same partners in reverse order
   (``d = p2/2, ..., 1``): exchange the range held with partner ``k xor d``,
   receiving straight into the tensor; the held range doubles each step.
6. Unfold: each odd position ``2k+1 < 2r`` sends the result to ``2k``.

Cost: ``2 log2(p2) alpha + 2(p2-1)/p2 n beta``, plus ``2 alpha + 2 n beta`` for the
fold and unfold when ``p`` is not a power of two (``r > 0``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from largebatch.comm.chunking import bounds, scratch
from largebatch.comm.compression import Codec
from largebatch.comm.p2p import exchange


def allreduce(flat: torch.Tensor, ranks: list[int], i: int, group: Optional[dist.ProcessGroup],
              codec: Codec) -> None:
    """Sum ``flat`` in place over ``ranks`` (this process is ``ranks[i]``), steps 1-6."""
    p = len(ranks)
    if p == 1:
        return
    n = flat.numel()
    p2 = 1 << (p.bit_length() - 1)
    r = p - p2
    wdt = codec.wire_dtype(flat.dtype)
    send_buf = scratch(n, wdt, flat.device, slot=1) if codec.lossy else None

    def encoded(x: torch.Tensor) -> torch.Tensor:
        return x if send_buf is None else codec.encode(x, send_buf[:x.numel()])

    # 1. fold the r extra ranks into their odd partners
    if i < 2 * r:
        if i % 2 == 0:
            exchange(encoded(flat), ranks[i + 1], None, -1, group)
            newrank = -1
        else:
            recv = scratch(n, wdt, flat.device, slot=0)
            exchange(None, -1, recv, ranks[i - 1], group)
            flat.add_(recv)
            newrank = i // 2
    else:
        newrank = i - r

    def real(k: int) -> int:
        return ranks[2 * k + 1] if k < r else ranks[k + r]

    if newrank >= 0:
        off = bounds(n, p2)                                           # 2. blocks
        lo, hi = 0, p2
        history: list[tuple[int, int]] = []
        d = 1
        while d < p2:                                                 # 3. recursive halving
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if newrank & d else ((lo, mid), (mid, hi))
            send = flat[off[give[0]]:off[give[1]]]
            dst = flat[off[keep[0]]:off[keep[1]]]
            recv = scratch(dst.numel(), wdt, flat.device, slot=0)
            exchange(encoded(send), real(newrank ^ d), recv, real(newrank ^ d), group)
            dst.add_(recv)
            history.append((lo, hi))
            lo, hi = keep
            d *= 2
        codec.round_(flat[off[lo]:off[hi]])                           # 4. round the owned block
        d = p2 // 2
        while d >= 1:                                                 # 5. recursive doubling
            plo, phi = history.pop()
            other = (hi, phi) if lo == plo else (plo, lo)
            send = flat[off[lo]:off[hi]]
            dst = flat[off[other[0]]:off[other[1]]]
            peer = real(newrank ^ d)
            if codec.lossy:
                recv = scratch(dst.numel(), wdt, flat.device, slot=0)
                exchange(encoded(send), peer, recv, peer, group)
                dst.copy_(recv)
            else:
                exchange(send, peer, dst, peer, group)
            lo, hi = plo, phi
            d //= 2

    # 6. unfold
    if i < 2 * r:
        if i % 2 == 1:
            exchange(encoded(flat), ranks[i - 1], None, -1, group)
        elif codec.lossy:
            recv = scratch(n, wdt, flat.device, slot=0)
            exchange(None, -1, recv, ranks[i + 1], group)
            flat.copy_(recv)
        else:
            exchange(None, -1, flat, ranks[i + 1], group)
