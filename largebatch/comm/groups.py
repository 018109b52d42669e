"""Sub-groups, created once, collectively, and cached per (parent group, partition).

``dist.new_group`` must be called by every rank of the world, in the same order,
even for groups a rank is not in. `partition_group` therefore creates *all*
blocks of a partition (all rows of a grid, all nodes, ...) in list order on
every rank, the first time any rank asks for that partition; since the
all-reduce that asks is itself collective, every rank asks at the same call.
The DDP hook calls `setup` from `register` (the main thread, before training)
so that no group is created later from the communication thread.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from largebatch.errors import UserError

_CACHE: dict[tuple, tuple[Optional[dist.ProcessGroup], list[int], int]] = {}


def _key(group: Optional[dist.ProcessGroup]) -> object:
    return "WORLD" if group is None or group is dist.group.WORLD else id(group)


def members(group: Optional[dist.ProcessGroup]) -> list[int]:
    """Global ranks of ``group`` in group-rank order."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def partition_group(group: Optional[dist.ProcessGroup], blocks: list[list[int]], tag: str = ""
                    ) -> tuple[Optional[dist.ProcessGroup], list[int], int]:
    """The sub-group of the block holding this rank, its global ranks, and this rank's index in it.

    ``blocks`` partitions the group ranks ``0..len(group)-1``; block members are
    translated to global ranks. Returns ``(subgroup, global_ranks, index)``. A different
    ``tag`` gives a second, separate set of groups for the same partition (the native-composed
    hook's all-gather groups, `largebatch.comm.composed`).
    """
    parent = members(group)
    key = (_key(group), tuple(tuple(b) for b in blocks), tag)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    if len(parent) != dist.get_world_size():
        raise UserError("torus2d and hierarchical need a group spanning all ranks (sub-groups are created "
                        "by every rank); call them with group=None or a group of the whole world.")
    me = dist.get_rank()
    mine = None
    for block in blocks:                        # every rank creates every block, in order
        ranks = [parent[k] for k in block]
        sub = dist.new_group(ranks=ranks) if len(ranks) > 1 else None
        if me in ranks:
            mine = (sub, ranks, ranks.index(me))
    assert mine is not None, "blocks must cover every rank"
    _CACHE[key] = mine
    return mine
