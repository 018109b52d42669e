"""Pipelined two-level all-reduce: the in-node steps of one piece overlap the cross-node step of another.

`torus2d` and `hierarchical` move a tensor in three stages: reduce-scatter inside a row/node
(fast links), all-reduce across rows/nodes (the slow network), all-gather inside again. Run
one after the other, the fast links idle while the network works and the other way round, so a
two-level scheme reaches the network's bound (a flat ring sends 1.5x the bytes out of a node on
2 x 2) only when the in-node stages cost nothing. Mikami et al. and Horovod's hierarchical
all-reduce hide them by pipelining; here:

1. Split the flat tensor into ``pieces`` near-equal pieces (`chunking.bounds`).
2. The calling thread reduce-scatters piece 1, 2, ... inside the node, handing each piece's
   owned chunk to one cross-node worker thread (a FIFO queue) as soon as it is reduced.
3. The worker all-reduces the chunks across nodes in that order, on the cross-node sub-group,
   while the caller reduce-scatters the next pieces.
4. The caller then waits for piece 1's cross-node result, all-gathers it inside the node, and so
   on: piece j's all-gather overlaps the cross-node all-reduce of pieces j+1, ....

Each sub-group is used by one thread only (in-node: the caller; cross-node: the worker), and
every rank issues the same sequence on each, so point-to-point messages and collective sequence
numbers match. One worker per process, made on first use; like the DDP hook's thread it only
waits in gloo and runs ``add_`` in ATen, both without the GIL. CPU (gloo) only: on CUDA the
stages already run asynchronously on the stream, so `allreduce` runs them one after the other.

Pieces trade overlap against latency: each adds ``2(K-1) + (cross steps)`` messages. ``auto``
takes one piece per `PIECE_BYTES` (at most `MAX_PIECES`). A cross level of one rank (one node,
or a torus grid with one row) has nothing to overlap, so it always runs as one piece. Pipelining pays
only when the cross level is a slower, separate network: with both levels on one host's cores
(1 host x 4 emulating 2 x 2, ``--grid 2x2 --local-size 2``) the pieces made 16-64 MB torus2d 18-33%
and hierarchical 3-24% slower than ``pipeline=1`` (docs/communication.md).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch
import torch.distributed as dist

from largebatch.comm.options import PIECES
from largebatch.comm import ring
from largebatch.comm.chunking import bounds
from largebatch.comm.compression import Codec

PIECE_BYTES, MAX_PIECES = PIECES["p2p"]                       # the table of defaults: largebatch.comm.options
COMPOSED_PIECE_BYTES, COMPOSED_MAX_PIECES = PIECES["native"]   # work handles: smaller pieces pay (PIECES' note)

_lock = threading.Lock()
_worker: Optional[ThreadPoolExecutor] = None

Group = tuple[Optional[dist.ProcessGroup], list[int], int]   # (subgroup, global ranks, index): groups.partition_group
Cross = Callable[[torch.Tensor, list[int], int, Optional[dist.ProcessGroup], Codec], None]


def pieces_for(pieces: Optional[int], nbytes: float, impl: str) -> int:
    """The piece count of a tensor of ``nbytes``: ``pieces`` as given, or for None one per `PIECE_BYTES`
    (1..`MAX_PIECES`) for the p2p form and one per `COMPOSED_PIECE_BYTES` (1..`COMPOSED_MAX_PIECES`) for the
    native-composed form. The performance model (`largebatch.perf.measured`) uses it too."""
    if pieces is not None:
        return max(1, int(pieces))
    size, most = (COMPOSED_PIECE_BYTES, COMPOSED_MAX_PIECES) if impl == "native" else (PIECE_BYTES, MAX_PIECES)
    return int(min(most, max(1, nbytes // size)))


def resolve_pieces(pieces: Optional[int], flat: torch.Tensor) -> int:
    """Step 1's piece count for ``flat``: `pieces_for`, at most one piece per element, 1 off the CPU."""
    if flat.device.type != "cpu":
        return 1
    return min(pieces_for(pieces, flat.numel() * flat.element_size(), "p2p"), max(1, flat.numel()))


def composed_pieces(pieces: Optional[int], flat: torch.Tensor) -> int:
    """The piece count of the native-composed form (`largebatch.comm.composed`): `pieces_for` on any
    device (its work handles overlap the levels on CUDA too), at most one piece per element."""
    return min(pieces_for(pieces, flat.numel() * flat.element_size(), "native"), max(1, flat.numel()))


def _cross_worker() -> ThreadPoolExecutor:
    global _worker
    with _lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="largebatch-cross")
        return _worker


def shutdown(timeout_s: float = 30.0) -> bool:
    """Stop the cross-level worker thread, if one was started; True when it has ended."""
    global _worker
    with _lock:
        worker, _worker = _worker, None
    if worker is None:
        return True
    worker.shutdown(wait=False, cancel_futures=True)
    threads = list(getattr(worker, "_threads", ()))
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


def two_level(flat: torch.Tensor, local: Group, cross: Group, cross_allreduce: Cross, codec: Codec,
              pieces: int) -> None:
    """Sum ``flat`` in place: ring reduce-scatter on ``local``, ``cross_allreduce`` of each owned chunk on
    ``cross``, ring all-gather on ``local``, over ``pieces`` pieces (steps 1-4; ``pieces == 1`` runs
    the three stages in order on the calling thread)."""
    (lg, lranks, li), (xg, xranks, xi) = local, cross
    own = ring.owned_chunk(li, len(lranks))
    if pieces <= 1 or len(xranks) == 1:   # a one-rank cross level has nothing to overlap with
        off = ring.reduce_scatter(flat, lranks, li, lg, codec)
        cross_allreduce(flat[off[own]:off[own + 1]], xranks, xi, xg, codec)
        ring.all_gather(flat, off, lranks, li, lg, codec)
        return
    cut = bounds(flat.numel(), pieces)                                                   # 1.
    worker = _cross_worker()
    pending: list[tuple[torch.Tensor, list[int], Future]] = []
    try:
        for j in range(pieces):                                                          # 2.
            piece = flat[cut[j]:cut[j + 1]]
            off = ring.reduce_scatter(piece, lranks, li, lg, codec)
            chunk = piece[off[own]:off[own + 1]]
            pending.append((piece, off, worker.submit(cross_allreduce, chunk, xranks, xi, xg, codec)))  # 3.
        for piece, off, done in pending:                                                 # 4.
            done.result()
            ring.all_gather(piece, off, lranks, li, lg, codec)
    finally:
        for _, _, done in pending:   # never leave the worker writing into a tensor the caller gave up
            try:
                done.result()
            except Exception:
                pass
