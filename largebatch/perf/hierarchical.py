"""Hierarchical all-reduce as Goyal et al. (arXiv 1706.02677) ran it: reduce inside each server,
all-reduce across servers, broadcast inside each server.

With g devices per node and n nodes:

1. Intra-node reduce to the node's first device: a ring reduce-scatter (g-1 steps of S/g) then a
   gather of the g-1 reduced chunks to the root (g-1 steps of S/g).
2. Inter-node all-reduce of the full S bytes among the n roots by recursive halving/doubling
   (one flow per node).
3. Intra-node broadcast from the root: scatter (g-1 steps of S/g) then ring all-gather
   (g-1 steps of S/g).
"""
from __future__ import annotations

from largebatch.perf import halving_doubling
from largebatch.perf.topology import Topology, ring_all_gather, ring_reduce_scatter


def cost(nbytes: float, topo: Topology) -> float:
    """Seconds for one hierarchical all-reduce of `nbytes` over all devices."""
    p, g = topo.devices, topo.devices_per_node
    if p < 2:
        return 0.0
    nodes = [list(range(s, min(s + g, p))) for s in range(0, p, g)]
    k = max(len(n) for n in nodes)
    chain = [(n[i], n[0]) for n in nodes for i in range(1, len(n))]
    hop = topo.step(chain, nbytes / k) if k > 1 else 0.0
    t = ring_reduce_scatter(topo, nodes, nbytes) + (k - 1) * hop                 # 1.
    t += halving_doubling.cost(nbytes, topo, [n[0] for n in nodes])              # 2.
    t += (k - 1) * hop + ring_all_gather(topo, nodes, nbytes)                    # 3.
    return t
