"""Where ranks sit: torus grids and node membership, validated into clear errors.

A torus grid ``"XxY"`` puts group rank ``k`` at row ``k // X`` and column
``k % X``: ``X`` processes along a row (by default the processes of one node, so
rows are intra-node), ``Y`` rows (by default the nodes). Node membership for
`hierarchical` is ``local_size`` consecutive group ranks per node, the torchrun
layout (``LOCAL_WORLD_SIZE`` processes on node ``GROUP_RANK``).
"""
from __future__ import annotations

import math
import re
from typing import Any, Optional

from largebatch.errors import UserError, env_int


def local_world_size(world: int) -> int:
    """Processes per node from torchrun's LOCAL_WORLD_SIZE (the whole world when unset)."""
    return env_int("LOCAL_WORLD_SIZE", world, low=1, high=world)


def parse_grid(grid: str, flag: str | None = None) -> tuple[int, int]:
    """``"XxY"`` -> ``(X, Y)``; anything else is a UserError naming comm.grid, or ``flag`` where the grid came
    from a command-line flag."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(grid))
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise UserError(f"{flag or 'torus2d grid'} {grid!r} is not of the form XxY with positive X and Y "
                        f"(e.g. 2x2); set {flag or 'comm.grid'} accordingly.")
    return int(m.group(1)), int(m.group(2))


def resolve_grid(grid: Optional[str], world: int, where: str = "the group size") -> tuple[int, int]:
    """The (X, Y) grid for ``world`` ranks: the option, or processes per node x nodes (``where`` names where
    ``world`` came from, for the message)."""
    if grid is None:
        x = local_world_size(world)
        if x < 1 or world % x:
            raise UserError(f"cannot derive a torus2d grid: {world} ranks do not split into nodes of "
                            f"LOCAL_WORLD_SIZE={x}; give comm.grid='XxY' with X*Y = {world}.")
        return x, world // x
    x, y = parse_grid(grid)
    if x * y != world:
        rows = max(d for d in range(1, math.isqrt(world) + 1) if world % d == 0)
        raise UserError(f"comm.grid is {grid} ({x * y} positions) but {where} is {world}; give a grid XxY with "
                        f"X*Y = {world}, e.g. comm.grid={world // rows}x{rows}.")
    return x, y


def mesh_layout(mesh: Any) -> tuple[int, int]:
    """The (X, Y) layout of a 2-D ``torch.distributed.device_mesh.DeviceMesh`` of shape (Y, X): dimension 0
    across nodes (torus columns, hierarchical's cross-node groups), dimension 1 within a node (torus rows,
    hierarchical's node groups), as ``init_device_mesh(device, (nodes, per_node))`` makes it for HSDP. One mesh
    so describes the layout of both torus2d and hierarchical. Its ranks must be 0..N-1 in row-major order (a
    node's processes consecutive, the torchrun layout) over the whole world; anything else is a UserError."""
    ranks = getattr(mesh, "mesh", None)
    if ranks is None or not hasattr(mesh, "ndim"):
        raise UserError(f"mesh is a {type(mesh).__name__}, not a DeviceMesh; give a 2-D "
                        "torch.distributed.device_mesh.init_device_mesh(device, (nodes, processes_per_node)).")
    if mesh.ndim != 2:
        raise UserError(f"mesh has {mesh.ndim} dimension(s); give a 2-D DeviceMesh of (nodes, processes_per_node).")
    y, x = (int(n) for n in ranks.shape)
    if ranks.flatten().tolist() != list(range(x * y)):
        raise UserError(f"mesh {ranks.tolist()} does not hold ranks 0..{x * y - 1} in row-major order; give "
                        "init_device_mesh(device, (nodes, processes_per_node)), whose rows are a node's "
                        "consecutive ranks.")
    return x, y


def grid_rows(x: int, y: int) -> list[list[int]]:
    """Group ranks of each row (length X)."""
    return [[row * x + c for c in range(x)] for row in range(y)]


def grid_cols(x: int, y: int) -> list[list[int]]:
    """Group ranks of each column (length Y)."""
    return [[row * x + c for row in range(y)] for c in range(x)]


def resolve_local_size(local_size: Optional[int], world: int, where: str = "the group size") -> int:
    """Processes per node for `hierarchical`: the option, or LOCAL_WORLD_SIZE (``where`` names where ``world``
    came from, for the message)."""
    k = local_world_size(world) if local_size is None else local_size
    if not isinstance(k, int) or isinstance(k, bool) or k < 1 or world % k:
        name = "LOCAL_WORLD_SIZE" if local_size is None else "comm.local_size"
        raise UserError(f"{name} is {k!r}, which does not divide {where} {world} into equal nodes; give a "
                        f"comm.local_size that divides {world} (or launch with torchrun --nproc-per-node).")
    return k


def node_blocks(k: int, world: int) -> list[list[int]]:
    """Group ranks of each node (k consecutive ranks)."""
    return [list(range(n * k, (n + 1) * k)) for n in range(world // k)]


def cross_blocks(k: int, world: int) -> list[list[int]]:
    """Group ranks with the same local rank, one list per local rank."""
    return [list(range(j, world, k)) for j in range(k)]
