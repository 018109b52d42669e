"""Two-level topology and the cost of one communication step on it (the alpha-beta-gamma model).

Ranks 0..p-1 fill nodes in order: rank r lives on node r // g (g devices per node). Inside a node
each device has its own intra-node link (alpha_i, per-direction bandwidth B_i). Between nodes a
node has `multiplicity` inter-node links (alpha_e, B_e each) that all flows leaving it share.

One step: every rank sends `m` bytes along its edge (src -> dst) at the same time; the step ends
when the slowest edge is done:

1. An edge inside a node costs alpha_i + m / B_i.
2. Edges that leave a node share its links: with f such edges out of the busiest node, each costs
   alpha_e + m * f / (multiplicity * B_e).
3. The step costs the maximum of (1) and (2) over the edges present; a reduction step adds
   gamma * m, gamma = 3 bytes of memory traffic per reduced byte / the device's memory bandwidth.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from largebatch.perf.catalog import Link


@dataclass(frozen=True)
class Topology:
    devices: int
    devices_per_node: int
    intra: Link
    inter: Link
    multiplicity: int = 1
    gamma_s_per_byte: float = 0.0

    @property
    def nodes(self) -> int:
        return -(-self.devices // self.devices_per_node)

    def node(self, rank: int) -> int:
        return rank // self.devices_per_node

    def flows(self, edges: Iterable[tuple[int, int]]) -> tuple[bool, int]:
        """Of one step: (an edge inside a node, the edges that leave the busiest node)."""
        per_node = self.devices_per_node
        intra = False
        out_flows: Counter[int] = Counter()
        for src, dst in edges:
            node = src // per_node
            if node == dst // per_node:
                intra = True
            else:
                out_flows[node] += 1
        return intra, max(out_flows.values(), default=0)

    def step_time(self, intra: bool, busiest: int, nbytes: float, reduce: bool = False) -> float:
        """Seconds for one step of `flows` (intra, busiest) in which each edge carries `nbytes` (steps 1-3)."""
        t = 0.0
        if intra:  # 1.
            t = self.intra.alpha_s + nbytes / self.intra.bandwidth_Bps
        if busiest:  # 2.
            t = max(t, self.inter.alpha_s + nbytes * busiest / (self.multiplicity * self.inter.bandwidth_Bps))
        if reduce and (intra or busiest):  # 3.
            t += self.gamma_s_per_byte * nbytes
        return t

    def step(self, edges: Iterable[tuple[int, int]], nbytes: float, reduce: bool = False) -> float:
        """Seconds for one step in which each (src, dst) edge carries `nbytes` (steps 1-3)."""
        return self.step_time(*self.flows(edges), nbytes, reduce)


def ring_edges(groups: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Directed edges of one ring per group (all groups step together)."""
    return [(g[i], g[(i + 1) % len(g)]) for g in groups if len(g) > 1 for i in range(len(g))]


@functools.lru_cache(maxsize=4096)
def _ring_flows(topo: Topology, groups: tuple[tuple[int, ...], ...]) -> tuple[bool, int]:
    """`Topology.flows` of one ring step in each group: a reduce-scatter and an all-gather of the same groups, and
    a planner sweep or fit that predicts the same world again, walk the edges once."""
    return topo.flows(ring_edges(groups))


def ring_reduce_scatter(topo: Topology, groups: Sequence[Sequence[int]], nbytes: float) -> float:
    """Ring reduce-scatter of `nbytes` within each group concurrently: k-1 steps of nbytes/k."""
    k = max(len(g) for g in groups)
    if k < 2:
        return 0.0
    return (k - 1) * topo.step_time(*_ring_flows(topo, tuple(map(tuple, groups))), nbytes / k, reduce=True)


def ring_all_gather(topo: Topology, groups: Sequence[Sequence[int]], nbytes: float) -> float:
    """Ring all-gather of a `nbytes` result within each group concurrently: k-1 steps of nbytes/k."""
    k = max(len(g) for g in groups)
    return 0.0 if k < 2 else (k - 1) * topo.step_time(*_ring_flows(topo, tuple(map(tuple, groups))), nbytes / k)


def pipelined(rs: float, cross: float, ag: float, pieces: int) -> float:
    """Seconds of a two-level all-reduce pipelined over `pieces` pieces (`largebatch.comm.pipeline`),
    given one piece's reduce-scatter, cross-level all-reduce and all-gather times.

    The caller runs the in-node stages, a worker the cross-level one: reduce-scatters back to back,
    piece j's cross step after its reduce-scatter and after piece j-1's cross step, piece j's
    all-gather after its cross step, the last reduce-scatter and piece j-1's all-gather.
    One piece gives rs + cross + ag.
    """
    cross_end, ends = 0.0, []
    for j in range(1, pieces + 1):
        cross_end = max(cross_end, j * rs) + cross
        ends.append(cross_end)
    t = pieces * rs
    for end in ends:
        t = max(t, end) + ag
    return t


def staged(stages: Callable[[float], tuple[float, float, float]], nbytes: float, pieces: int,
           queued: bool = False) -> float:
    """Seconds of a two-level all-reduce of `nbytes` in `pieces` pieces, from `stages(piece_bytes)` = one
    piece's (reduce-scatter, cross all-reduce, all-gather) times: `pipelined`. With `queued` (the pieces are
    work handles issued ahead, as the native-composed form does) each stage's latency, its time at 0 bytes,
    is paid once rather than per piece, and only the byte terms are pipelined."""
    full = stages(nbytes / pieces)
    if not queued or pieces == 1:
        return pipelined(*full, pieces)
    latency = stages(0.0)
    rs, cross, ag = (f - a for f, a in zip(full, latency))
    return pipelined(rs, cross, ag, pieces) + sum(latency)
