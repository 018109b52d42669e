"""Recursive halving / doubling all-reduce (Rabenseifner 2004; Thakur, Rabenseifner, Gropp 2005),
the inter-server algorithm of Goyal et al.: 2 log2 p steps instead of the ring's 2(p-1).

For p ranks, p' = 2^floor(log2 p) and r = p - p':

1. If p is not a power of two, the first 2r ranks pair up (2i, 2i+1): the even rank sends its
   whole vector (S bytes) to the odd one, which adds it; the r even ranks then sit out.
2. Reduce-scatter by recursive halving over the p' remaining ranks: in step k = 0..log2 p' - 1
   each rank exchanges half of its current part (S / 2^(k+1) bytes) with the rank at distance
   2^k and reduces the half it keeps.
3. All-gather by recursive doubling: the same exchanges in reverse order, without reduction.
4. If p is not a power of two, each odd rank of step 1 sends the result (S bytes) back to its
   even partner.

Cost for a power of two on one link: 2 log2(p) alpha + 2(p-1)/p S beta + (p-1)/p S gamma.
Nearest partners first keeps the largest messages inside a node.
"""
from __future__ import annotations

from typing import Sequence

from largebatch.perf.topology import Topology


def cost(nbytes: float, topo: Topology, ranks: Sequence[int] | None = None,
         groups: Sequence[Sequence[int]] | None = None) -> float:
    """Seconds for one halving/doubling all-reduce of `nbytes` over `ranks` (default: all devices).

    `groups` instead runs one all-reduce per group at the same time (equal sizes), each step's
    edges of all groups together, so flows of different groups share a node's links (the
    cross-node phase of `largebatch.perf.hierarchical`).
    """
    if groups is None:
        groups = [list(range(topo.devices)) if ranks is None else list(ranks)]
    groups = [list(g) for g in groups if len(g) > 1]
    if not groups:
        return 0.0
    p = len(groups[0])
    p2 = 1 << (p.bit_length() - 1)
    r = p - p2
    t = 0.0
    if r:  # 1. fold the extra ranks in
        pairs = [(g[2 * i], g[2 * i + 1]) for g in groups for i in range(r)]
        t += topo.step(pairs, nbytes, reduce=True)
    actives = [[g[2 * i + 1] for i in range(r)] + list(g[2 * r:]) for g in groups]
    steps = p2.bit_length() - 1
    halving = 0.0
    doubling = 0.0
    for k in range(steps):
        d = 1 << k
        edges = [(a[i], a[i ^ d]) for a in actives for i in range(p2)]
        m = nbytes / (1 << (k + 1))
        halving += topo.step(edges, m, reduce=True)  # 2.
        doubling += topo.step(edges, m)              # 3.
    t += halving + doubling
    if r:  # 4. send the result back
        t += topo.step([(g[2 * i + 1], g[2 * i]) for g in groups for i in range(r)], nbytes)
    return t
