"""The one list of all-reduce algorithm names and of their options: config, comm, perf and the benchmarks read
them from here.

`OPTIONS` is the single table of the options an algorithm takes beyond ``compression``: each option's default,
the algorithms that read it and its documentation. `largebatch.comm.dispatch.resolve` validates against it,
`largebatch.comm.hook.CommHookState` takes its fields from it, and `config.CommConfig` documents its keys from
it (a test holds that CommConfig has exactly these keys); an option added here is an option everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ALLREDUCE = ("native", "ring", "halving_doubling", "torus2d", "hierarchical")   # `largebatch.comm`, one file each
TWO_LEVEL = ("torus2d", "hierarchical")   # the algorithms with two implementations
IMPLS = ("p2p", "native")                 # their implementations: point-to-point steps, or the backend's collectives
DEFAULT_IMPL = "native"                   # the default: one backend collective per level, future-chained in DDP
HOOK_ONLY = ("noop",)                     # DDP hook only: no communication, the compute-only ceiling
MODEL_ONLY = ("tree",)                    # the performance model only: NCCL's double binary tree
P2P = ("ring", "halving_doubling")        # point-to-point only
INTER = ("halving_doubling", "ring", "native")   # hierarchical's cross-node all-reduce

# Below this many bytes the p2p algorithms hand the tensor to `native` (the small-message fast path; 0 = off). A
# compromise between the loaded 1 host x 4 and 2 x 2 cluster measurements (docs/communication.md).
SMALL_BYTES = 256 << 10

# The default piece count of `pipeline` (largebatch.comm.pipeline.pieces_for): one piece per BYTES of the tensor, at
# most MOST, per implementation. The p2p form pays a Python round trip per piece; the native-composed form issues
# work handles, so smaller pieces pay (docs/communication.md: torus2d:native at 16 MB, 1.40x native's busbw with 8
# pieces, 1.46x with 16).
PIECES = {"p2p": (4 << 20, 8), "native": (1 << 20, 32)}


def pieces_default() -> str:
    """The default of `pipeline` in words, from `PIECES`: what the option table, the errors and the docs say."""
    return ", ".join(f"one piece per {size >> 20} MB (at most {most}) for {impl}" for impl, (size, most) in PIECES.items())


@dataclass(frozen=True)
class Option:
    """One algorithm option: its default (None: derived at run time, as the doc says), the algorithms that read
    it, and what it does."""

    default: Any
    algorithms: tuple[str, ...]
    doc: str


OPTIONS: dict[str, Option] = {
    "grid": Option(None, ("torus2d",), "torus2d grid 'XxY' (default: processes per node x nodes)"),
    "pipeline": Option(None, TWO_LEVEL,
                       "torus2d/hierarchical: pieces of a tensor overlapped across the two levels (default "
                       f"{pieces_default()}; 1 = off). As a DDP hook, impl p2p only: the native hook overlaps whole "
                       "buckets instead, so make them smaller with comm.bucket_mb"),
    "impl": Option(DEFAULT_IMPL, TWO_LEVEL,
                   "torus2d/hierarchical: 'native' (the backend's reduce-scatter, all-reduce and all-gather, "
                   "future-chained, no thread; the default) or 'p2p' (point-to-point steps on a communication "
                   "thread)"),
    "local_size": Option(None, ("hierarchical",), "hierarchical: processes per node (default: torchrun's "
                                                  "LOCAL_WORLD_SIZE)"),
    "inter": Option("halving_doubling", ("hierarchical",),
                    f"hierarchical: cross-node all-reduce, one of {', '.join(INTER)} (default halving_doubling)"),
    "small_bytes": Option(SMALL_BYTES, P2P + TWO_LEVEL,
                          "p2p algorithms: buckets below this many bytes use native (default 256 KiB, 0 = off)"),
}


def options_of(algorithm: str) -> dict[str, Any]:
    """The options `algorithm` reads, with their defaults (none for native and noop)."""
    return {name: opt.default for name, opt in OPTIONS.items() if algorithm in opt.algorithms}
