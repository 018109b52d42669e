"""Hierarchical all-reduce: reduce-scatter inside each node, all-reduce across nodes, all-gather inside.

The layout of `largebatch.comm.hierarchical` (one definition for the performance model and the
implementation): the structure of Goyal et al. (arXiv 1706.02677, section 4: intra-server reduce,
inter-server recursive halving/doubling, intra-server broadcast) and of Horovod's hierarchical
all-reduce, with the intra-node reduce and broadcast replaced by the bandwidth-optimal ring
reduce-scatter and all-gather. With g devices per node (K = g) and n nodes:

1. Intra-node ring reduce-scatter: g-1 steps of S/g; local rank j then holds the node sum of 1/g
   of the gradient.
2. Inter-node all-reduce of those S/g bytes among the devices of the same local rank, `inter`
   (recursive halving/doubling by default, as in Goyal et al.; or a ring), all g of them at once,
   so g flows leave each node and share its links. The bytes crossing a node's links equal those
   of Goyal's one-root-per-node layout; the intra-node part takes 2(g-1) steps of S/g instead of
   Goyal's 4(g-1) (reduce = reduce-scatter + gather, broadcast = scatter + all-gather).
3. Intra-node ring all-gather: g-1 steps of S/g.

With `pieces` > 1 the three steps run pipelined over that many pieces of the gradient
(`largebatch.comm.pipeline`, `topology.pipelined`).

A partial last node (devices not a multiple of g) is modelled with the same step counts; its
missing local ranks simply send nothing in step 2.
"""
from __future__ import annotations

from largebatch.perf import halving_doubling
from largebatch.perf.topology import Topology, ring_all_gather, ring_reduce_scatter, staged

INTER = ("halving_doubling", "ring", "native")   # native (the backend's collective) is modelled as a ring


def cost(nbytes: float, topo: Topology, inter: str = "halving_doubling", pieces: int = 1,
         queued: bool = False) -> float:
    """Seconds for one hierarchical all-reduce of `nbytes` over all devices (steps 1-3); `queued`: the pieces
    are work handles issued ahead (the native-composed form), so each stage's latency is paid once."""
    if inter not in INTER:
        raise ValueError(f"no inter-node algorithm {inter!r}")
    p, g = topo.devices, topo.devices_per_node
    if p < 2:
        return 0.0
    nodes = [list(range(s, min(s + g, p))) for s in range(0, p, g)]
    k = max(len(n) for n in nodes)
    cross = [[n[j] for n in nodes if j < len(n)] for j in range(k)]
    pieces = pieces if len(nodes) > 1 else 1                                       # nothing to overlap

    def stages(piece: float) -> tuple[float, float, float]:
        part = piece / k
        x = 0.0
        if len(nodes) > 1:                                                          # 2.
            if inter == "halving_doubling":
                x = halving_doubling.cost(part, topo, groups=[c for c in cross if len(c) == len(nodes)])
            else:
                x = ring_reduce_scatter(topo, cross, part) + ring_all_gather(topo, cross, part)
        return ring_reduce_scatter(topo, nodes, piece), x, ring_all_gather(topo, nodes, piece)   # 1., 3.

    return staged(stages, nbytes, pieces, queued)
