"""Predicted time of each all-reduce of `largebatch.comm` from measured links (`largebatch bench allreduce`).

One cost model serves the planner and the benchmark: `largebatch.perf` describes each algorithm
as a sequence of steps on a two-level topology (`largebatch.perf.topology`: alpha + bytes / B
per step on intra-node and inter-node links, flows leaving a node share its links, gamma per
reduced byte), and its ring / halving_doubling / torus2d / hierarchical functions follow the
same steps as the files of `largebatch.comm`. Here:

1. The links are *measured*, not fitted per algorithm (`largebatch bench allreduce` does it):
   one step of `largebatch.comm.p2p.exchange`, every rank at once, on the intra-node ring
   (each rank sends to the next rank of its node) and, with two or more nodes, across nodes
   (each rank sends to the same local rank of the next node, so K flows leave each node),
   for a range of message sizes; and the local ``add_`` of m bytes (gamma).
2. `fit_link`: alpha and beta of one link from those step times, ``T(m) = alpha + f m beta``
   (f flows sharing the link), Hockney's way: beta from the large messages (>= `LARGE_BYTES`,
   the bandwidth regime that the big all-reduces live in; least squares on the absolute time),
   alpha from the small ones (< `SMALL_FIT_BYTES`, what is left of their time after f m beta).
   One relative-error line through all sizes fitted the small messages and missed the large:
   on 1 host x 4 loopback a step of 16 MB took 25 ms while that line said 19 ms (the step time
   grows faster than linearly once messages leave the caches). gamma likewise comes from the
   adds of >= `LARGE_BYTES` (out of cache, every rank adding at once).
3. `topology`: the perf `Topology` of the run (p ranks, K per node, the two links, gamma).
4. `predict`: the options of the implementation (torus grid, inter-node algorithm, pipeline
   pieces, the small-message fast path: a p2p algorithm below its ``small_bytes`` threshold runs
   ``native``) resolved as `largebatch.comm` resolves them, then `largebatch.perf.model.allreduce_time`,
   the planner's one dispatch of algorithm names to cost functions (``native`` as the backend runs it:
   gloo's ring, or NCCL's faster of ring and tree).

So each algorithm's prediction is a prediction: no timing of that algorithm goes into it.
"""
from __future__ import annotations

from typing import Optional, Sequence

from largebatch.comm.pipeline import pieces_for
from largebatch.comm.topology import parse_grid
from largebatch.comm.options import DEFAULT_IMPL, TWO_LEVEL
from largebatch.perf.catalog import Link
from largebatch.perf.topology import Topology


def fit(coeffs: Sequence[tuple[float, float]], times: Sequence[float]) -> tuple[float, float]:
    """``(x, y)`` >= 0 minimising sum(((a_i x + b_i y) / t_i - 1)^2) for rows ``(a_i, b_i)``."""
    xs = [(a / t, b / t) for (a, b), t in zip(coeffs, times)]
    s11 = sum(u * u for u, _ in xs)
    s12 = sum(u * v for u, v in xs)
    s22 = sum(v * v for _, v in xs)
    r1 = sum(u for u, _ in xs)
    r2 = sum(v for _, v in xs)
    det = s11 * s22 - s12 * s12
    if det > 0:
        x, y = (r1 * s22 - r2 * s12) / det, (r2 * s11 - r1 * s12) / det
        if x >= 0 and y >= 0:
            return x, y
    # one of them would be negative: fit the other alone
    only_x = (r1 / s11 if s11 else 0.0, 0.0)
    only_y = (0.0, r2 / s22 if s22 else 0.0)

    def loss(xy: tuple[float, float]) -> float:
        return sum((u * xy[0] + v * xy[1] - 1.0) ** 2 for u, v in xs)

    return min(only_x, only_y, key=loss)


LARGE_BYTES = 1 << 20
SMALL_FIT_BYTES = 64 << 10


def _slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Ordinary least squares ``y = a + b x``; ``(a, b)``, b through the origin for a single point."""
    n = len(xs)
    if n == 1:
        return 0.0, ys[0] / xs[0] if xs[0] else 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def fit_link(name: str, sizes: Sequence[float], times: Sequence[float], flows: int = 1) -> Link:
    """Step 2: the `Link` (alpha, bandwidth) whose step time ``alpha + flows * m / B`` fits ``times``:
    beta from the large messages, alpha from the small ones (falling back to the relative-error
    fit through all sizes when either range is empty)."""
    large = [(flows * m, t) for m, t in zip(sizes, times) if m >= LARGE_BYTES]
    small = [(flows * m, t) for m, t in zip(sizes, times) if m < SMALL_FIT_BYTES]
    if len(large) < 2 or not small:
        alpha, beta = fit([(1.0, flows * m) for m in sizes], times)
    else:
        beta = max(_slope([x for x, _ in large], [t for _, t in large])[1], 0.0)
        alpha = max(sum(t - x * beta for x, t in small) / len(small), 0.0)
    return Link(name, alpha, 1.0 / beta if beta > 0 else float("inf"), source="measured step times")


def fit_gamma(sizes: Sequence[float], times: Sequence[float]) -> float:
    """Seconds per reduced byte from timings of ``add_`` on ``sizes`` bytes: the slope over the sizes of
    at least `LARGE_BYTES` when there are two (out of cache), else through the origin over all."""
    large = [(m, t) for m, t in zip(sizes, times) if m >= LARGE_BYTES]
    if len(large) >= 2:
        return max(_slope([m for m, _ in large], [t for _, t in large])[1], 0.0)
    return fit([(0.0, m) for m in sizes], times)[1]


def topology(p: int, local_size: int, intra: Link, inter: Optional[Link], gamma: float = 0.0) -> Topology:
    """Step 3: ``p`` ranks, ``local_size`` per node; one node needs no inter-node link."""
    return Topology(p, local_size, intra, inter if inter is not None else intra, 1, gamma)


def predict(algorithm: str, nbytes: float, topo: Topology, grid: Optional[str] = None,
            inter: str = "halving_doubling", small_bytes: int = 0, local_size: Optional[int] = None,
            pipeline: Optional[int] = None, backend: str = "gloo", impl: str = DEFAULT_IMPL) -> float:
    """Step 4: predicted seconds of one all-reduce of ``nbytes`` on ``topo``.

    ``grid`` (torus2d "XxY") defaults to K x nodes like the implementation; ``local_size``, when
    given, must be the topology's (hierarchical always uses the node size of ``topo``); ``pipeline``
    is the option of the same name (None: the implementation's default piece count on CPU); ``impl`` the
    implementation of torus2d/hierarchical ("p2p" or "native"), whose default piece counts differ.
    """
    if local_size is not None and local_size != topo.devices_per_node:
        raise ValueError(f"local_size {local_size} differs from the topology's {topo.devices_per_node}")
    from largebatch.perf.model import allreduce_time

    if algorithm != "native" and nbytes < small_bytes:
        algorithm = "native"                                     # the small-message fast path
    torus_x = None
    if algorithm == "torus2d":
        torus_x = parse_grid(grid)[0] if grid else topo.devices_per_node
    pieces = pieces_for(pipeline, nbytes, impl) if algorithm in TWO_LEVEL else 1
    return allreduce_time(algorithm, nbytes, topo, torus_x, inter=inter, pieces=pieces, backend=backend,
                          queued=impl == "native")
