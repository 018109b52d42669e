"""Two-level all-reduce composed of the backend's own collectives (``impl="native"`` of `torus2d` and
`hierarchical`): the form real systems use (Sony's 2D-torus on NCCL, Horovod's hierarchical
all-reduce), where the point-to-point form (``impl="p2p"``) is the reference implementation.

The layout is the p2p form's: a *local* level (a torus row, or the processes of one node) and a
*cross* level (a torus column, or the processes with the same local rank on every node),
the sub-groups of `largebatch.comm.groups`.

1. Pad the flat tensor to a multiple of the local size K (the collectives need equal chunks).
2. ``reduce_scatter_tensor`` on the local group: local rank j holds the local sum of chunk j.
3. All-reduce that chunk on the cross group: ``all_reduce`` (``inter="native"``, and always for
   torus2d), or a p2p algorithm (hierarchical ``inter="halving_doubling" | "ring"``).
4. ``all_gather_into_tensor`` on the local group, and copy back (without the padding).

On gloo, step 2 is an ``all_to_all_single`` of the K chunks (the same bytes per rank as a ring
reduce-scatter) whose receiver adds them: gloo's ``reduce_scatter_tensor`` costs more than its whole
``all_reduce`` (16 MB on 2 processes of one host: 19.0 ms against 13.1, the exchange and the sum 9.2 ms;
scripts/gloo_collectives.py).

`allreduce` pipelines over pieces with ``async_op=True`` work handles, from one thread: every
piece's reduce-scatter is issued first, then, in piece order, each piece's cross step as soon as
its reduce-scatter is done, then each piece's all-gather as soon as its cross step is done. gloo
runs each group's work on that group's own threads and NCCL on its own streams, so the in-node
step of piece k+1 overlaps the cross step of piece k without a Python thread.

`Chain` is the DDP comm hook's form: no thread, the hook issues step 2 and returns a future
whose callbacks issue steps 3 and 4 (`torch.futures.Future.then`, as torch's PowerSGD hook
does). On gloo step 2 is the exchange above, whose callback adds the chunks. Every rank must issue each group's collectives in one order; the hook issues step 2 on
the autograd thread (bucket order), while callbacks run on whichever backend thread completes a
bucket's previous step. So steps 3 and 4 each get a group of their own (the all-gather runs on a
second copy of the local groups) and callbacks take their turn in bucket order (a ticket per
step): one issuing order per group on every rank.

Where one level has a single rank (a grid of one row or one column, one node, one process per node),
the two levels are a flat all-reduce over the other, and both forms call the backend's ``all_reduce``
on it.

Compression: the caller pre-divides by p (`largebatch.comm.run`); the collectives then run in the
wire dtype and the backend accumulates in it, as in `native` with compression.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist

from largebatch.comm.chunking import bounds
from largebatch.comm.compression import Codec

# torch 2.13 names them reduce_scatter_single / all_gather_single (the *_tensor names are deprecated)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

Group = tuple[Optional[dist.ProcessGroup], list[int], int]   # (subgroup, global ranks, index): groups.partition_group
Cross = Callable[[torch.Tensor, list[int], int, Optional[dist.ProcessGroup], Codec], None]


def _padded(flat: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Step 1: ``flat`` in ``dtype``, padded with zeros to a multiple of ``k`` (a copy only where needed)."""
    n = flat.numel()
    size = -(-n // k) * k
    if size == n and dtype == flat.dtype:
        return flat
    out = torch.zeros(size, dtype=dtype, device=flat.device)
    out[:n].copy_(flat)
    return out


def _flat_group(local: Group, cross: Group, cross_p2p: Optional[Cross]) -> Optional[Group]:
    """The one level that has more than one rank, when the other has one (a torus grid of one row or one
    column, one node, one process per node): there the two levels are a flat all-reduce over that level,
    and the backend's own ``all_reduce`` is its fastest form. None when both levels are real, or when the
    cross level runs a p2p algorithm."""
    if len(cross[1]) == 1:
        return local
    if len(local[1]) == 1 and cross_p2p is None:
        return cross
    return None


def _scatter(buf: torch.Tensor, out: torch.Tensor, local: Group
             ) -> tuple[Optional[dist.Work], Optional[torch.Tensor]]:
    """Step 2 started: ``out`` is to get this rank's chunk of ``buf`` summed over the local group. Returns the
    work (None when the local group is one rank: copied at once) and, on gloo, the exchanged chunks that
    `_scatter_done` adds (gloo's reduce-scatter costs more than its all-reduce)."""
    group, ranks, _ = local
    if len(ranks) == 1:
        out.copy_(buf)
        return None, None
    if dist.get_backend(group) == "gloo":
        recv = torch.empty_like(buf)
        return dist.all_to_all_single(recv, buf, group=group, async_op=True), recv
    return _reduce_scatter(out, buf, group=group, async_op=True), None


def _scatter_done(out: torch.Tensor, recv: Optional[torch.Tensor]) -> None:
    """Step 2 finished, after its work: on gloo, the sum of the exchanged chunks into ``out``."""
    if recv is not None:
        torch.sum(recv.view(-1, out.numel()), dim=0, out=out)


def _cross_native(chunk: torch.Tensor, cross: Group, async_op: bool):
    group, ranks, _ = cross
    if len(ranks) == 1:
        return None
    return dist.all_reduce(chunk, group=group, async_op=async_op)


def allreduce(flat: torch.Tensor, local: Group, cross: Group, codec: Codec, pieces: int = 1,
              cross_p2p: Optional[Cross] = None) -> None:
    """Sum ``flat`` in place (steps 1-4), pipelined over ``pieces``; ``cross_p2p`` replaces step 3's
    ``all_reduce`` with a p2p algorithm (run on this thread, so it does not overlap). CUDA tensors on
    gloo (which lacks CUDA reduce-scatter) go through a host copy."""
    if flat.is_cuda and _backend(local, cross) == "gloo":
        host = flat.cpu()
        allreduce(host, local, cross, codec, pieces, cross_p2p)
        flat.copy_(host)
        return
    flat_level = _flat_group(local, cross, cross_p2p)
    if flat_level is not None:                      # one real level: the backend's all-reduce on it
        whole = _padded(flat, 1, codec.wire_dtype(flat.dtype))
        if len(flat_level[1]) > 1:
            dist.all_reduce(whole, group=flat_level[0])
        if whole.data_ptr() != flat.data_ptr():
            flat.copy_(whole)
        return
    lg, lranks, _ = local
    k = len(lranks)
    wire = codec.wire_dtype(flat.dtype)
    cut = bounds(flat.numel(), max(1, min(pieces, flat.numel())))
    bufs, outs, recvs, works = [], [], [], []
    for j in range(len(cut) - 1):                                               # 1.-2.
        buf = _padded(flat[cut[j]:cut[j + 1]], k, wire)
        out = torch.empty(buf.numel() // k, dtype=wire, device=flat.device)
        work, recv = _scatter(buf, out, local)
        bufs.append(buf)
        outs.append(out)
        recvs.append(recv)
        works.append(work)
    cross_works: list[Optional[dist.Work]] = []
    for out, recv, work in zip(outs, recvs, works):                             # 3.
        if work is not None:
            work.wait()
        _scatter_done(out, recv)
        if cross_p2p is not None:
            cross_p2p(out, cross[1], cross[2], cross[0], _lossless(out.dtype))
            cross_works.append(None)
        else:
            cross_works.append(_cross_native(out, cross, async_op=True))
    gathers = []
    for buf, out, work in zip(bufs, outs, cross_works):                         # 4.
        if work is not None:
            work.wait()
        gathers.append(_all_gather(buf, out, group=lg, async_op=True) if k > 1 else None)
        if k == 1:
            buf.copy_(out)
    for j, (buf, work) in enumerate(zip(bufs, gathers)):
        if work is not None:
            work.wait()
        piece = flat[cut[j]:cut[j + 1]]
        if buf.data_ptr() != piece.data_ptr():
            piece.copy_(buf[:piece.numel()])


def _backend(*groups: Group) -> str:
    """The backend of the first real sub-group (one-rank levels have none)."""
    for g in groups:
        if g[0] is not None:
            return dist.get_backend(g[0])
    return dist.get_backend()


def _lossless(dtype: torch.dtype) -> Codec:
    """The chunk is already in the wire dtype: the p2p cross step sends it as it is."""
    from largebatch.comm.compression import get_codec

    return get_codec("none", dtype)


class _Turns:
    """Tickets: `wait(i)` returns once tickets 0..i-1 were `done`, so callbacks act in bucket order."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._next = 0

    def wait(self, i: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._next == i)

    def done(self) -> None:
        with self._cv:
            self._next += 1
            self._cv.notify_all()


class Chain:
    """The future-chained hook form (see the module docstring): ``submit(buffer, scale)`` returns a future
    completed with ``buffer`` averaged in place over local x cross ranks."""

    def __init__(self, local: Group, cross: Group, gather: Group, codec_name: str,
                 cross_p2p: Optional[Cross] = None) -> None:
        self.local, self.cross, self.gather = local, cross, gather
        self.codec_name, self.cross_p2p = codec_name, cross_p2p
        self._tickets = 0
        self._cross_turns, self._gather_turns = _Turns(), _Turns()

    def submit(self, buffer: torch.Tensor, world: int) -> torch.futures.Future:
        from largebatch.comm.compression import get_codec

        codec = get_codec(self.codec_name, buffer.dtype)
        buffer.div_(world)                                                      # DDP averages; pre-divided
        flat_level = _flat_group(self.local, self.cross, self.cross_p2p)
        if flat_level is not None:                  # one real level: the backend's all-reduce on it
            wire_buf = _padded(buffer, 1, codec.wire_dtype(buffer.dtype))

            def copy_back(f: torch.futures.Future) -> torch.Tensor:
                f.wait()
                if wire_buf.data_ptr() != buffer.data_ptr():
                    buffer.copy_(wire_buf)
                return buffer

            return dist.all_reduce(wire_buf, group=flat_level[0], async_op=True).get_future().then(copy_back)
        ticket, self._tickets = self._tickets, self._tickets + 1
        k = len(self.local[1])
        wire = codec.wire_dtype(buffer.dtype)
        buf = _padded(buffer, k, wire)
        out = torch.empty(buf.numel() // k, dtype=wire, device=buffer.device)
        work, recv = _scatter(buf, out, self.local)                             # 2., autograd thread
        if work is not None:
            fut = work.get_future()
        else:
            fut = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
            fut.set_result([out])

        def cross_step(f: torch.futures.Future) -> torch.Tensor:                # 3., in bucket order
            f.wait()
            _scatter_done(out, recv)
            self._cross_turns.wait(ticket)
            try:
                if self.cross_p2p is not None:
                    self.cross_p2p(out, self.cross[1], self.cross[2], self.cross[0], _lossless(out.dtype))
                    work = None
                else:
                    work = _cross_native(out, self.cross, async_op=True)
            finally:
                self._cross_turns.done()
            if work is not None:
                work.wait()
            self._gather_turns.wait(ticket)                                     # 4., in bucket order
            try:
                work = (_all_gather(buf, out, group=self.gather[0], async_op=True)
                        if k > 1 else None)
            finally:
                self._gather_turns.done()
            if work is not None:
                work.wait()
            else:
                buf.copy_(out)
            if buf.data_ptr() != buffer.data_ptr():
                buffer.copy_(buf[:buffer.numel()])
            return buffer

        return fut.then(cross_step)
