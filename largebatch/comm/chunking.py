"""Chunking helpers: split a flat tensor of any length into near-equal pieces.

A length ``n`` split into ``parts`` pieces gives the first ``n % parts`` pieces one
extra element, so every length and every world size work (pieces may be empty when
``n < parts``; the point-to-point helpers skip empty messages on both sides, which
agree because both compute the same offsets).
"""
from __future__ import annotations

import threading

import torch


def bounds(n: int, parts: int) -> list[int]:
    """Offsets ``[0, o_1, ..., n]`` of ``parts`` near-equal pieces of ``n`` elements."""
    q, r = divmod(n, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + q + (1 if i < r else 0))
    return out


def piece(flat: torch.Tensor, offsets: list[int], lo: int, hi: int | None = None) -> torch.Tensor:
    """View of pieces ``lo .. hi-1`` (``hi = lo + 1`` by default) of ``flat``: no copy."""
    hi = lo + 1 if hi is None else hi
    return flat[offsets[lo]:offsets[hi]]


_local = threading.local()


def scratch(numel: int, dtype: torch.dtype, device: torch.device, slot: int = 0) -> torch.Tensor:
    """A reusable receive buffer of at least ``numel`` elements (per thread, dtype, device, slot).

    Buffers grow and are kept, so repeated all-reduces of the same size allocate
    nothing. Per thread because the DDP hook runs on its own communication thread.
    Stream-ordered reuse makes this safe on CUDA as long as one thread uses one stream.
    """
    cache: dict = _local.__dict__.setdefault("buffers", {})
    key = (dtype, device, slot)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
        cache[key] = buf
    return buf[:numel]
