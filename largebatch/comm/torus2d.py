"""2D-torus all-reduce over an X x Y grid of ranks (Mikami et al., arXiv 1811.05233).

Ranks sit on a grid of ``Y`` rows of ``X`` ranks (group rank ``k`` at row
``k // X``, column ``k % X``); by default ``X`` = processes per node and ``Y`` =
nodes, so rows stay inside a node and only columns cross the network.

1. Reduce-scatter along each row (ring, `ring.reduce_scatter`): the rank in
   column ``c`` ends with the row-sum of chunk ``(c + 1) mod X`` (1/X of the tensor).
2. All-reduce that chunk along each column (ring over the ``Y`` ranks of the
   column, on the column's own sub-group): it now holds the global sum.
3. All-gather along each row (`ring.all_gather`): every rank ends with the whole sum.

Steps 1-3 run pipelined over pieces of the tensor (``pipeline`` option; default
`largebatch.comm.options.PIECES`, see `largebatch.comm.pipeline`), so the row steps of one piece overlap
the column all-reduce of another.

``impl="native"`` runs the same three steps as the backend's own collectives
(`largebatch.comm.composed`: ``reduce_scatter_tensor`` on the row, ``all_reduce`` on the
column, ``all_gather_into_tensor`` on the row; the default); ``impl="p2p"`` runs them as the
point-to-point rings above.

Bytes sent per rank equal the ring's, ``2(N-1)/N n``; latency steps are
``2(X-1) + 2(Y-1)`` instead of ``2(N-1)``. The row and column sub-groups are
created once for the whole grid (`largebatch.comm.groups`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from largebatch.comm.options import DEFAULT_IMPL
from largebatch.comm import composed, ring
from largebatch.comm.pipeline import composed_pieces, resolve_pieces, two_level
from largebatch.comm.compression import Codec
from largebatch.comm.groups import partition_group
from largebatch.comm.topology import grid_cols, grid_rows, resolve_grid


def setup(group: Optional[dist.ProcessGroup], world: int, grid: Optional[str], gather: bool = False) -> tuple:
    """Create (once) and return ``(row, col)`` as ``(subgroup, global_ranks, index)`` triples, and with
    ``gather`` a second copy of the rows (the native-composed hook's all-gather groups)."""
    x, y = resolve_grid(grid, world)
    out = partition_group(group, grid_rows(x, y)), partition_group(group, grid_cols(x, y))
    return out + (partition_group(group, grid_rows(x, y), tag="gather"),) if gather else out


def allreduce(flat: torch.Tensor, ranks: list[int], i: int, group: Optional[dist.ProcessGroup],
              codec: Codec, grid: Optional[str] = None, pipeline: Optional[int] = None, impl: str = DEFAULT_IMPL) -> None:
    """Sum ``flat`` in place over ``group`` arranged as ``grid`` (steps 1-3)."""
    row, col = setup(group, len(ranks), grid)
    if impl == "native":
        composed.allreduce(flat, row, col, codec, composed_pieces(pipeline, flat))
        return
    two_level(flat, row, col, ring.allreduce, codec, resolve_pieces(pipeline, flat))
