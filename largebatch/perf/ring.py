"""Ring all-reduce (Patarasuk and Yuan 2009; Baidu's ring-allreduce; NCCL's rings).

p ranks in a ring, the gradient of S bytes cut into p chunks:

1. Reduce-scatter: p-1 steps; in each, every rank sends one chunk (S/p bytes) to the next rank
   and adds the chunk it receives.
2. All-gather: p-1 steps; every rank forwards the reduced chunk it holds.

Cost: 2(p-1) alpha + 2(p-1)/p S beta + (p-1)/p S gamma, where alpha and beta are those of the
slowest edge of the ring (an inter-node hop as soon as the ring spans nodes; one flow per node
leaves it, because ranks are ordered node by node).
"""
from __future__ import annotations

from typing import Sequence

from largebatch.perf.topology import Topology, ring_all_gather, ring_reduce_scatter


def cost(nbytes: float, topo: Topology, ranks: Sequence[int] | None = None) -> float:
    """Seconds for one ring all-reduce of `nbytes` over `ranks` (default: all devices)."""
    group = [list(range(topo.devices)) if ranks is None else list(ranks)]
    return ring_reduce_scatter(topo, group, nbytes) + ring_all_gather(topo, group, nbytes)  # 1. + 2.
