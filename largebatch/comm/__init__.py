"""All-reduce algorithms over torch.distributed point-to-point, and DDP comm hooks.

``allreduce(tensor, algorithm="ring", group=None, **options)`` sums ``tensor`` in
place across ``group`` and returns it. Algorithms, one file each:

=================  ==========================================================
native             the backend's own all_reduce (gloo / NCCL): the baseline
ring               ring reduce-scatter + all-gather (bandwidth-optimal)
halving_doubling   recursive halving + doubling, any world size (fold/unfold)
torus2d            rows reduce-scatter, columns all-reduce, rows all-gather
hierarchical       node reduce-scatter, cross-node all-reduce, node all-gather
=================  ==========================================================

Options: ``compression`` (``none``, ``fp16``, ``bf16``: wire format only, see
`largebatch.comm.compression`), ``grid="XxY"`` (torus2d), ``local_size=K`` and
``inter=halving_doubling|ring|native`` (hierarchical), ``impl=native|p2p`` (torus2d and
hierarchical: composed of the backend's own collectives, `largebatch.comm.composed`, the default; or
point-to-point steps), ``pipeline=N`` (torus2d and
hierarchical: pieces overlapped across the two levels, `largebatch.comm.pipeline`;
default `largebatch.comm.options.PIECES`: one per 1 MB for native, per 4 MB for p2p; 1 = no overlap; as a DDP hook p2p only), ``mesh`` (torus2d and hierarchical: a 2-D
``DeviceMesh`` of (nodes, processes per node) in place of ``grid`` / ``local_size``), ``small_bytes=B`` (every
p2p algorithm: tensors of fewer than ``B`` bytes go to ``native`` instead, the
small-message fast path; default `SMALL_BYTES`, 0 turns it off). ``None`` values
are ignored, so a config section can pass all its fields; a set option that the
algorithm does not read is a UserError.

The fast path is the same latency/bandwidth switch as NCCL's tree/ring choice:
below a few hundred KB an all-reduce is latency-bound, and the backend's C++
collective takes far fewer host round trips than a Python-driven sequence of
point-to-point steps (docs/communication.md: measured on 1 host x 4 and 2 x 2).

The options, their defaults and the algorithms that read them are one table,
`largebatch.comm.options.OPTIONS`. ``register(ddp_model, CommHookState(algorithm, **options))`` installs the
chosen algorithm as DDP's comm hook (`largebatch.comm.hook`); ``install(ddp_model, cfg.comm)`` does it for a run's
config section (none for native uncompressed: DDP's own all-reduce); ``algorithm="noop"`` communicates
nothing, to measure the compute-only ceiling.
"""
from __future__ import annotations

from largebatch.comm.options import SMALL_BYTES
from largebatch.comm.dispatch import ALGORITHMS, OPTIONS, Spec, allreduce, resolve, run, setup
from largebatch.comm.hook import CommHookState, install, register

__all__ = ["ALGORITHMS", "OPTIONS", "SMALL_BYTES", "CommHookState", "Spec", "allreduce", "install", "register", "resolve",
           "run", "setup"]
