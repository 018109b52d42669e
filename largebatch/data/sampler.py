"""Exactly-once samplers: one global shuffle per epoch, split across ranks.

Goyal et al. (arXiv 1706.02677, section 2.3): "we use a single random shuffling of the
training data (per epoch) that is divided amongst all k workers". The steps:

1. ``epoch_permutation``: every rank draws the same permutation of ``0..n-1`` from a
   ``torch.Generator`` seeded by ``(seed, epoch)`` only, so no communication is needed
   and a resumed run sees the same order.
2. ``steps_per_epoch``: ``n // global_batch`` steps; the incomplete tail is dropped,
   so every image is seen at most once per training epoch (and each step has the full
   global batch, which the lr scaling rule assumes).
3. ``rank_batch``: step ``s`` takes ``perm[s*B:(s+1)*B]``; rank ``r`` of ``w`` takes the
   ``r``-th contiguous chunk of ``B / w`` indices. Chunks are disjoint and steps are
   disjoint, so no index repeats within an epoch across all ranks.
4. ``eval_shard``: evaluation is not shuffled; rank ``r`` takes a contiguous range whose
   size differs from the others by at most one. No padding duplicates, no dropped
   tail: summing per-rank correct counts gives exact test accuracy.

All functions are pure and run on the host; none of them synchronises a device.
"""
from __future__ import annotations

import torch

from largebatch.errors import UserError

_EPOCH_STRIDE = 1_000_003  # a prime: (seed, epoch) pairs map to distinct generator seeds


def _generator_seed(seed: int, epoch: int) -> int:
    return (int(seed) * _EPOCH_STRIDE + int(epoch)) % (2**63 - 1)


def epoch_permutation(n: int, epoch: int, seed: int) -> torch.Tensor:
    """Step 1: the epoch's global order, identical on every rank (int64, length n)."""
    gen = torch.Generator().manual_seed(_generator_seed(seed, epoch))
    return torch.randperm(n, generator=gen, dtype=torch.int64)


def steps_per_epoch(n: int, global_batch: int) -> int:
    """Step 2: full global batches in one epoch (the tail is dropped)."""
    if global_batch <= 0:
        raise UserError(f"the global batch is {global_batch}; it must be positive (batch.global_batch).")
    return n // global_batch


def rank_batch(perm: torch.Tensor, step: int, global_batch: int, rank: int, world: int) -> torch.Tensor:
    """Step 3: this rank's contiguous chunk of the step's global batch."""
    if global_batch % world:
        raise UserError(f"the global batch {global_batch} is not divisible by the world size {world}; "
                        f"choose a global batch that is a multiple of {world} (batch.global_batch).")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}")
    per_rank = global_batch // world
    start = step * global_batch + rank * per_rank
    if step < 0 or (step + 1) * global_batch > perm.numel():
        raise ValueError(f"step {step} is outside the epoch of {perm.numel() // global_batch} full steps")
    return perm[start:start + per_rank]


def eval_shard(n: int, rank: int, world: int) -> torch.Tensor:
    """Step 4: contiguous evaluation shard; the first n % world ranks get one more."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    size = base + (1 if rank < extra else 0)
    return torch.arange(start, start + size, dtype=torch.int64)
