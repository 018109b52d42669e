"""The dispatch behind `largebatch.comm.allreduce`: algorithm names and their options, validated into a `Spec`
once, then run on any tensor (the small-message fast path, compression's pre-scaling, averaging).

1. `resolve(algorithm, options)`: a frozen `Spec` (name, wire format, every option with its default); any
   mistake is one UserError naming the choices.
2. `run(tensor, spec, group)`: the sum (or average) in place over `group`; tensors under ``small_bytes`` go to
   the backend's own all-reduce, lossy wire formats pre-divide by the group size.
3. `setup(algorithm, group)`: the sub-groups an algorithm needs, created collectively ahead of first use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from largebatch.comm import halving_doubling, hierarchical, native, ring, torus2d
from largebatch.comm.compression import WIRE_DTYPES, get_codec
from largebatch.comm.groups import members
from largebatch.comm.options import ALLREDUCE, HOOK_ONLY, IMPLS, TWO_LEVEL, options_of, pieces_default
from largebatch.comm.options import OPTIONS as TABLE
from largebatch.errors import UserError

ALGORITHMS: dict[str, Callable[..., None]] = {
    "native": native.allreduce,
    "ring": ring.allreduce,
    "halving_doubling": halving_doubling.allreduce,
    "torus2d": torus2d.allreduce,
    "hierarchical": hierarchical.allreduce,
}
# Algorithm-specific options (beyond `compression`) and their defaults: `largebatch.comm.options.OPTIONS`, the one
# table of them, per algorithm.
OPTIONS: dict[str, dict[str, Any]] = {name: options_of(name) for name in ALLREDUCE}
assert tuple(ALGORITHMS) == ALLREDUCE, "largebatch.comm.options.ALLREDUCE names every algorithm here"


@dataclass(frozen=True)
class Spec:
    """A validated algorithm choice: name, wire format and algorithm options."""

    algorithm: str
    compression: str = "none"
    options: tuple[tuple[str, Any], ...] = ()


def resolve(algorithm: str, options: dict[str, Any], allow_noop: bool = False, prefix: str = "") -> Spec:
    """Validate ``algorithm`` and ``options`` into a `Spec`; mistakes are UserErrors. ``prefix``: how a sentence
    names the options ("comm." for a run's config section, whose keys they are)."""
    names = list(ALGORITHMS) + (list(HOOK_ONLY) if allow_noop else [])
    if algorithm not in names:
        raise UserError(f"unknown all-reduce algorithm {algorithm!r}; choose one of: {', '.join(names)}.")
    options = {k: v for k, v in options.items() if v is not None}
    if "mesh" in options and algorithm in TWO_LEVEL:
        mesh = options.pop("mesh")
        options.update(mesh_options(algorithm, mesh, options))
    compression = options.pop("compression", "none")
    if compression not in WIRE_DTYPES:
        raise UserError(f"unknown compression {compression!r}; choose one of: {', '.join(WIRE_DTYPES)}.")
    valid = OPTIONS.get(algorithm, {})
    unknown = sorted(set(options) - set(valid))
    if unknown and prefix and unknown[0] in TABLE:
        readers = TABLE[unknown[0]].algorithms
        raise UserError(f"{prefix}{unknown[0]} is set but {prefix}algorithm {algorithm} does not use it; remove it, "
                        f"or choose an algorithm that does ({', '.join(readers)}).")
    if unknown:
        raise UserError(f"option(s) {', '.join(unknown)} do not apply to algorithm {algorithm}; "
                        f"its options: {', '.join(['compression', *valid])}.")
    merged = {**valid, **options}
    if "inter" in merged and merged["inter"] not in hierarchical.INTER:
        raise UserError(f"hierarchical inter={merged['inter']!r} is unknown; "
                        f"choose one of: {', '.join(hierarchical.INTER)}.")
    if "impl" in merged and merged["impl"] not in IMPLS:
        raise UserError(f"impl={merged['impl']!r} is unknown; choose one of: {', '.join(IMPLS)} "
                        "(native: the backend's reduce-scatter / all-reduce / all-gather, p2p: point-to-point steps).")
    if "small_bytes" in merged:
        sb = merged["small_bytes"]
        if isinstance(sb, bool) or not isinstance(sb, int) or sb < 0:
            raise UserError(f"small_bytes={sb!r} must be a whole number of bytes >= 0 (0 turns the "
                            f"small-message fast path off).")
    if merged.get("pipeline") is not None:
        pl = merged["pipeline"]
        if isinstance(pl, bool) or not isinstance(pl, int) or pl < 1:
            raise UserError(f"pipeline={pl!r} must be a whole number of pieces >= 1 (1 turns the overlap of "
                            f"the two levels off), or left unset for the default: {pieces_default()}.")
    if "grid" in merged and merged["grid"] is not None:
        from largebatch.comm.topology import parse_grid

        parse_grid(merged["grid"])
    return Spec(algorithm, compression, tuple(sorted(merged.items())))


def mesh_options(algorithm: str, mesh: Any, options: dict[str, Any]) -> dict[str, Any]:
    """A 2-D DeviceMesh as the layout option it stands for: torus2d's grid "XxY", hierarchical's local_size X
    (`largebatch.comm.topology.mesh_layout`). The sub-groups stay largebatch's own: the hook's collectives are
    issued from backend callbacks and must never interleave with the caller's own on the mesh's groups."""
    from largebatch.comm.topology import mesh_layout, parse_grid

    x, y = mesh_layout(mesh)
    if dist.is_available() and dist.is_initialized() and x * y != dist.get_world_size():
        raise UserError(f"mesh has {x * y} ranks but the world has {dist.get_world_size()}; give a mesh over "
                        "the whole world.")
    if algorithm == "torus2d":
        if options.get("grid") is not None and parse_grid(options["grid"]) != (x, y):
            raise UserError(f"grid={options['grid']!r} and the mesh's {x}x{y} disagree; give one of them.")
        return {"grid": f"{x}x{y}"}
    if options.get("local_size") is not None and options["local_size"] != x:
        raise UserError(f"local_size={options['local_size']} and the mesh's {x} processes per node disagree; "
                        "give one of them.")
    return {"local_size": x}


def check_layout(algorithm: str, opts: dict[str, Any], p: int, where: str = "the group size", *,
                 given_only: bool = False) -> None:
    """Raise the UserError the algorithm would raise for an impossible grid / node size on ``p`` ranks (``where``
    names where ``p`` came from). ``given_only``: check only a layout the options give, not one derived from
    LOCAL_WORLD_SIZE (a dry run, before the launch that sets it)."""
    from largebatch.comm.topology import resolve_grid, resolve_local_size

    key = {"torus2d": "grid", "hierarchical": "local_size"}.get(algorithm)
    if key is None or (given_only and opts.get(key) is None):
        return
    (resolve_grid if key == "grid" else resolve_local_size)(opts.get(key), p, where)


def run(tensor: torch.Tensor, spec: Spec, group: Optional[dist.ProcessGroup] = None,
        average: bool = False) -> torch.Tensor:
    """Sum (or, with ``average``, average) ``tensor`` in place over ``group`` with ``spec``.

    Lossy compression pre-scales by 1/p before the first cast and, for a sum,
    multiplies by p after the last, so fp16 cannot overflow (see
    `largebatch.comm.compression`).
    """
    codec = get_codec(spec.compression, tensor.dtype)
    if average and not tensor.dtype.is_floating_point:
        raise UserError(f"averaging needs a floating-point tensor, not {tensor.dtype}.")
    if not (dist.is_available() and dist.is_initialized()):
        return tensor                                   # world size 1: the sum is the tensor
    ranks = members(group)
    me = dist.get_rank()
    if me not in ranks:
        return tensor
    p, i = len(ranks), ranks.index(me)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = work.view(-1)
    if p > 1 and flat.numel():
        opts = dict(spec.options)
        algorithm = spec.algorithm
        if flat.numel() * flat.element_size() < opts.pop("small_bytes", 0):
            check_layout(algorithm, opts, p)            # an impossible grid is an error at any size
            algorithm, opts = "native", {}              # small-message fast path (latency-bound)
        if codec.lossy:
            flat.div_(p)                                # pre-scale: no fp16 overflow on the wire
        ALGORITHMS[algorithm](flat, ranks, i, group, codec, **opts)
        if codec.lossy and not average:
            flat.mul_(p)
        elif not codec.lossy and average:
            flat.div_(p)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def allreduce(tensor: torch.Tensor, algorithm: str = "ring", group: Optional[dist.ProcessGroup] = None,
              **options: Any) -> torch.Tensor:
    """Sum ``tensor`` in place across ``group`` with ``algorithm``; returns ``tensor``.

    Collective: every rank of ``group`` calls it with the same algorithm, options
    and tensor length. The first torus2d/hierarchical call creates the sub-groups
    (every rank of the world must take part in that call).
    """
    return run(tensor, resolve(algorithm, options), group)


def setup(algorithm: str, group: Optional[dist.ProcessGroup] = None, **options: Any) -> None:
    """Create the sub-groups ``algorithm`` needs now, collectively (optional; first use does it too)."""
    spec = resolve(algorithm, options, allow_noop=True)
    if not (dist.is_available() and dist.is_initialized()):
        return
    opts = dict(spec.options)
    world = len(members(group))
    if spec.algorithm == "torus2d":
        torus2d.setup(group, world, opts["grid"])
    elif spec.algorithm == "hierarchical":
        hierarchical.setup(group, world, opts["local_size"])
