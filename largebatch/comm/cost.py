"""Alpha-beta cost of each all-reduce as implemented here, and a fit of alpha and beta to timings.

An algorithm's time is modelled as ``T(n) = a * alpha + b(n) * beta``: ``a`` message
steps of latency ``alpha`` (s) on its critical path and ``b(n)`` bytes sent per
rank at ``beta`` s/byte (beta absorbs the ``add_`` of the reduction too). For
``p`` ranks and ``n`` bytes:

=================  ===========================  =====================================
ring, native       a = 2(p-1)                   b = 2(p-1)/p n
halving_doubling   a = 2 log2 p2 (+2 if r > 0)  b = 2(p2-1)/p2 n (+2n if r > 0)
torus2d X x Y      a = 2(X-1) + 2(Y-1)          b = 2(X-1)/X n + 2(Y-1)/Y n/X
hierarchical K     a = 2(K-1) + a_inter(p/K)    b = 2(K-1)/K n + b_inter(p/K, n/K)
=================  ===========================  =====================================

with ``p2`` the largest power of two <= p and ``r = p - p2``; ``native`` (gloo's or
NCCL's own algorithm) is modelled as a ring. `largebatch.perf` models the same
ring / halving-doubling / torus costs on a two-level topology; its hierarchical
model is the leader-based variant (reduce to one rank per node), not the
reduce-scatter variant implemented in `largebatch.comm.hierarchical`, so these
formulas are kept here, next to the code they describe.

`fit` finds alpha and beta by least squares on the *relative* error (each timing
weighted by 1/T), so that small and large messages count alike, with alpha and
beta kept non-negative.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from largebatch.comm.topology import parse_grid


def coefficients(algorithm: str, p: int, nbytes: float, grid: Optional[str] = None,
                 local_size: Optional[int] = None, inter: str = "halving_doubling") -> tuple[float, float]:
    """``(a, b)`` with ``T = a * alpha + b * beta`` for one all-reduce of ``nbytes`` over ``p`` ranks."""
    if p < 2:
        return 0.0, 0.0
    if algorithm in ("ring", "native"):
        return 2.0 * (p - 1), 2.0 * (p - 1) / p * nbytes
    if algorithm == "halving_doubling":
        p2 = 1 << (p.bit_length() - 1)
        a, b = 2.0 * math.log2(p2), 2.0 * (p2 - 1) / p2 * nbytes
        if p > p2:
            a, b = a + 2.0, b + 2.0 * nbytes
        return a, b
    if algorithm == "torus2d":
        x, y = parse_grid(grid) if grid else (p, 1)
        a_col, b_col = coefficients("ring", y, nbytes / x)
        return 2.0 * (x - 1) + a_col, 2.0 * (x - 1) / x * nbytes + b_col
    if algorithm == "hierarchical":
        k = local_size or p
        a_in, b_in = coefficients(inter if inter != "native" else "ring", p // k, nbytes / k)
        return 2.0 * (k - 1) + a_in, 2.0 * (k - 1) / k * nbytes + b_in
    raise ValueError(f"no cost model for {algorithm!r}")


def predict(algorithm: str, p: int, nbytes: float, alpha: float, beta: float, **layout) -> float:
    """Predicted seconds of one all-reduce."""
    a, b = coefficients(algorithm, p, nbytes, **layout)
    return a * alpha + b * beta


def fit(algorithm: str, p: int, sizes: Sequence[float], times: Sequence[float], **layout) -> tuple[float, float]:
    """``(alpha, beta)`` minimising sum(((a alpha + b_i beta) / t_i - 1)^2), both >= 0."""
    rows = [coefficients(algorithm, p, n, **layout) for n in sizes]
    xs = [(a / t, b / t) for (a, b), t in zip(rows, times)]
    s11 = sum(u * u for u, _ in xs)
    s12 = sum(u * v for u, v in xs)
    s22 = sum(v * v for _, v in xs)
    r1 = sum(u for u, _ in xs)
    r2 = sum(v for _, v in xs)
    det = s11 * s22 - s12 * s12
    if det > 0:
        alpha, beta = (r1 * s22 - r2 * s12) / det, (r2 * s11 - r1 * s12) / det
        if alpha >= 0 and beta >= 0:
            return alpha, beta
    # one of them would be negative: fit the other alone
    only_alpha = (r1 / s11 if s11 else 0.0, 0.0)
    only_beta = (0.0, r2 / s22 if s22 else 0.0)

    def loss(ab: tuple[float, float]) -> float:
        return sum((u * ab[0] + v * ab[1] - 1.0) ** 2 for u, v in xs)

    return min(only_alpha, only_beta, key=loss)
