"""The one list of all-reduce algorithm names: config, comm, perf and the benchmarks read it from here."""
from __future__ import annotations

ALLREDUCE = ("native", "ring", "halving_doubling", "torus2d", "hierarchical")   # `largebatch.comm`, one file each
TWO_LEVEL = ("torus2d", "hierarchical")   # the algorithms with two implementations
IMPLS = ("p2p", "native")                 # their implementations: point-to-point steps, or the backend's collectives
DEFAULT_IMPL = "native"                   # the default: one backend collective per level, future-chained in DDP
HOOK_ONLY = ("noop",)                     # DDP hook only: no communication, the compute-only ceiling
MODEL_ONLY = ("tree",)                    # the performance model only: NCCL's double binary tree
