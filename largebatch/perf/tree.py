"""Tree all-reduce in the style of NCCL's double binary trees (Sanders, Speck, Träff 2009).

A pipelined chain inside each node, and a binary tree over the nodes (one rank per node);
the message is cut into many chunks so the pipeline is full and each phase moves about S
bytes through every link (two trees, each carrying half, each node interior in at most one):

1. Reduce along the chain inside each node: g-1 latency steps + S over the intra-node link.
2. Reduce up the binary tree over n nodes: ceil(log2 n) latency steps + S over the node's links.
3. Broadcast down the tree: ceil(log2 n) latency steps + S.
4. Broadcast along the chain inside each node: g-1 latency steps + S.

Reductions add gamma * S once in (1) and once in (2). Latency grows with log2 n instead of n,
at the price of a bandwidth term (2S beta_e) that does not shrink with p like the ring's
2(p-1)/p S: trees win for small messages on many nodes.
"""
from __future__ import annotations

import math

from largebatch.perf.topology import Topology


def cost(nbytes: float, topo: Topology) -> float:
    """Seconds for one tree all-reduce of `nbytes` over all devices."""
    p, g = topo.devices, topo.devices_per_node
    if p < 2:
        return 0.0
    n = topo.nodes
    k = min(g, p)
    t = 0.0
    if k > 1:  # 1. + 4.
        chain = topo.intra.alpha_s * (k - 1) + nbytes / topo.intra.bandwidth_Bps
        t += 2 * chain + topo.gamma_s_per_byte * nbytes
    if n > 1:  # 2. + 3.
        depth = math.ceil(math.log2(n))
        phase = depth * topo.inter.alpha_s + nbytes / (topo.multiplicity * topo.inter.bandwidth_Bps)
        t += 2 * phase + topo.gamma_s_per_byte * nbytes
    return t
