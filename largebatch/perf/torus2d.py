"""2D-torus all-reduce (Mikami et al., Sony, arXiv 1811.05233).

The p ranks form an X x Y grid, rank = y * X + x (a row is X consecutive ranks):

1. Reduce-scatter along each row (a ring of X ranks): X-1 steps of S/X bytes.
2. All-reduce along each column (a ring of Y ranks) of the S/X bytes each rank holds:
   2(Y-1) steps of S/(XY) bytes.
3. All-gather along each row: X-1 steps of S/X bytes.

With `pieces` > 1 the three steps run pipelined over that many pieces of the gradient
(`largebatch.comm.pipeline`, `topology.pipelined`).

Bytes per rank equal the ring's, 2S(p-1)/p; latency steps are 2(X-1) + 2(Y-1) instead of 2(p-1).
All rows (and all columns) run concurrently, so the column rings share the inter-node links:
with X >= g every device of a node leaves it in step 2.
"""
from __future__ import annotations

import math

from largebatch.errors import UserError
from largebatch.perf.topology import Topology, ring_all_gather, ring_reduce_scatter, staged


def grid(p: int, x: int | None = None, topo: Topology | None = None, nbytes: float = 0.0) -> tuple[int, int]:
    """(X, Y) with X * Y = p; `x` given, or the divisor with the lowest cost (X >= 2 preferred)."""
    if x is not None:
        if x < 1 or p % x:
            divisors = [d for d in range(1, p + 1) if p % d == 0]
            raise UserError(f"torus row length {x} does not divide {p} devices; choose one of: "
                            f"{', '.join(map(str, divisors[:40]))}{' ...' if len(divisors) > 40 else ''}.")
        return x, p // x
    if topo is None:
        x = max(d for d in range(1, math.isqrt(p) + 1) if p % d == 0)
        return p // x, x
    best = min((cost(nbytes, topo, d), d) for d in range(1, p + 1) if p % d == 0)
    return best[1], p // best[1]


def cost(nbytes: float, topo: Topology, x: int | None = None, pieces: int = 1, queued: bool = False) -> float:
    """Seconds for one 2D-torus all-reduce of `nbytes` over all devices on an X-wide grid; `queued`: the
    pieces are work handles issued ahead (the native-composed form), so each stage's latency is paid once."""
    p = topo.devices
    if p < 2:
        return 0.0
    if x is None:
        x, _ = grid(p, None, topo, nbytes)
    y = p // x
    rows = [list(range(j * x, (j + 1) * x)) for j in range(y)]
    cols = [list(range(i, p, x)) for i in range(x)]
    pieces = pieces if y > 1 else 1                                                    # nothing to overlap

    def stages(piece: float) -> tuple[float, float, float]:
        part = piece / x
        return (ring_reduce_scatter(topo, rows, piece),                                # 1.
                ring_reduce_scatter(topo, cols, part) + ring_all_gather(topo, cols, part),  # 2.
                ring_all_gather(topo, rows, piece))                                    # 3.

    return staged(stages, nbytes, pieces, queued)
