"""Hierarchical all-reduce: inside nodes, then across nodes, then inside nodes again.

The structure of Goyal et al. (2017, section 4: intra-server reduce, inter-server
recursive halving/doubling, intra-server broadcast) and of Horovod's hierarchical
all-reduce, with the intra-node reduce and broadcast replaced by the
bandwidth-optimal reduce-scatter and all-gather. ``K`` processes per node
(``local_size`` option, else torchrun's LOCAL_WORLD_SIZE); node ``m`` holds group
ranks ``mK .. mK+K-1``.

1. Reduce-scatter inside each node (ring over the node's ``K`` ranks): local rank
   ``j`` holds the node-sum of chunk ``(j + 1) mod K``.
2. All-reduce that chunk across nodes among the processes of the same local rank
   (``inter`` option: ``halving_doubling`` by default, as in Goyal et al.;
   ``ring``; or ``native``, the backend's collective on the cross-node sub-group).
   The ``K`` cross-node all-reduces run in parallel, one per local rank, each
   carrying 1/K of the tensor.
3. All-gather inside each node (ring).

Steps 1-3 run pipelined over pieces of the tensor (``pipeline`` option; default
`largebatch.comm.options.PIECES`, see `largebatch.comm.pipeline`), so the in-node steps of one piece
overlap the cross-node all-reduce of another.

``impl="native"`` runs steps 1 and 3 as the backend's ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` on the node group, and step 2 as its ``all_reduce`` (``inter="native"``)
or the p2p algorithm named by ``inter`` (`largebatch.comm.composed`; the default); ``impl="p2p"``
runs steps 1 and 3 as point-to-point rings.

Differs from `torus2d` (same data movement with a ring across nodes) by the
cross-node algorithm: with halving/doubling its latency term is
``2 log2(nodes)`` instead of ``2(nodes - 1)``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from largebatch.comm import options as algorithms
from largebatch.comm.options import DEFAULT_IMPL
from largebatch.comm import composed, halving_doubling, native, ring
from largebatch.comm.pipeline import composed_pieces, resolve_pieces, two_level
from largebatch.comm.compression import Codec
from largebatch.comm.groups import partition_group
from largebatch.comm.topology import cross_blocks, node_blocks, resolve_local_size
from largebatch.errors import UserError

INTER = {"halving_doubling": halving_doubling.allreduce, "ring": ring.allreduce, "native": native.allreduce}
assert tuple(INTER) == algorithms.INTER, "largebatch.comm.options.INTER names every cross-node algorithm here"


def setup(group: Optional[dist.ProcessGroup], world: int, local_size: Optional[int], gather: bool = False) -> tuple:
    """Create (once) and return ``(node, cross)`` as ``(subgroup, global_ranks, index)`` triples, and with
    ``gather`` a second copy of the node groups (the native-composed hook's all-gather groups)."""
    k = resolve_local_size(local_size, world)
    out = partition_group(group, node_blocks(k, world)), partition_group(group, cross_blocks(k, world))
    return out + (partition_group(group, node_blocks(k, world), tag="gather"),) if gather else out


def allreduce(flat: torch.Tensor, ranks: list[int], i: int, group: Optional[dist.ProcessGroup],
              codec: Codec, local_size: Optional[int] = None, inter: str = "halving_doubling",
              pipeline: Optional[int] = None, impl: str = DEFAULT_IMPL) -> None:
    """Sum ``flat`` in place over ``group`` with ``local_size`` ranks per node (steps 1-3)."""
    if inter not in INTER:
        raise UserError(f"hierarchical inter={inter!r} is unknown; choose one of: {', '.join(INTER)}.")
    node, cross = setup(group, len(ranks), local_size)
    if impl == "native":
        composed.allreduce(flat, node, cross, codec, composed_pieces(pipeline, flat),
                           None if inter == "native" else INTER[inter])
        return
    two_level(flat, node, cross, INTER[inter], codec, resolve_pieces(pipeline, flat))
