"""largebatch.comm against exact sums and against the backend's all_reduce, on real gloo processes.

Each world size (2, 3, 4, 6, 8) is spawned once; inside it every algorithm x
compression x awkward length runs, plus explicit torus grids, hierarchical node
sizes, integer and float64 tensors, and (at 2 and 3 ranks) the DDP hooks: one
pytest case per algorithm and layout (`_groups`), so a failure names its case.

Tolerances, with S = sum over ranks of |x_r| elementwise and u the unit roundoff:
lossless float32 within p * 2^-23 * S of the exact float64 sum (summation order);
fp16 / bf16 compression within (p + 3) * u * S (u = 2^-11 / 2^-8): at most one
rounding to the wire format per partial sum, plus pre-scale and rescale.
Integers and float64 sums must be exact / within 2^-50 S. All ranks must agree bit for bit.
"""
from __future__ import annotations

import datetime
import functools
import itertools
import json
import multiprocessing
import os
import pickle
import re
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from largebatch import comm
from largebatch.comm.options import DEFAULT_IMPL, TWO_LEVEL
from largebatch.dist import end_process
from largebatch.errors import UserError

COMPRESSIONS = ("none", "fp16", "bf16")
UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
GRIDS = {2: ["2x1", "1x2"], 3: ["3x1", "1x3"], 4: ["2x2", "4x1"], 6: ["2x3", "3x2"], 8: ["4x2", "2x4"]}
LOCAL_SIZES = {2: [1, 2], 3: [1, 3], 4: [2, 4], 6: [2, 3], 8: [2, 4]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(p: int, n: int, case: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """The tensor each rank contributes: every rank can rebuild all of them, so the exact sum needs no communication."""
    out = []
    for r in range(p):
        g = torch.Generator().manual_seed(1000 * case + r)
        if dtype.is_floating_point:
            out.append((torch.randn(n, generator=g, dtype=torch.float64) * (1 + r)).to(dtype))
        else:
            out.append(torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype))
    return out


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    ref = t.clone()
    dist.broadcast(ref, 0)
    ok = torch.tensor([int(torch.equal(ref, t))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def _check(p: int, rank: int, n: int, case: int, algorithm: str, compression: str = "none",
           dtype: torch.dtype = torch.float32, **options) -> None:
    xs = _inputs(p, n, case, dtype)
    if algorithm != "native":
        options.setdefault("small_bytes", 0)        # run the algorithm itself, not the small-message fast path
    got = comm.allreduce(xs[rank].clone(), algorithm, compression=compression, **options)
    what = f"{algorithm} {options} compression={compression} n={n} p={p} dtype={dtype}"
    assert got.dtype == dtype and got.shape == (n,), what
    if not dtype.is_floating_point:
        assert torch.equal(got, torch.stack(xs).sum(0)), what
    else:
        exact = torch.stack([x.double() for x in xs]).sum(0)
        scale = torch.stack([x.double().abs() for x in xs]).sum(0)
        if compression == "none":
            eps = 2.0 ** -50 if dtype == torch.float64 else 2.0 ** -23
            tol = p * eps * scale
        else:
            tol = (p + 3) * UNIT_ROUNDOFF[compression] * scale + 1e-7 * p
        err = (got.double() - exact).abs()
        assert bool((err <= tol).all()), f"{what}: max error {float((err - tol).max()):.3g} over tolerance"
        native = comm.allreduce(xs[rank].clone(), "native", compression=compression)
        assert bool(((got.double() - native.double()).abs() <= 2 * tol).all()), f"{what} differs from native"
    assert _same_on_all_ranks(got), f"{what}: ranks disagree"


def _check_mesh(p: int, rank: int, local_world: int) -> None:
    """A 2-D DeviceMesh of (nodes, processes per node) stands for torus2d's grid and hierarchical's local_size:
    the same sums as native, the hook takes the layout from it; a mesh that is not such a layout is refused."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from largebatch.comm.hook import CommHookState

    nodes = p // local_world
    mesh = init_device_mesh("cpu", (nodes, local_world), mesh_dim_names=("cross", "local"))
    for case, (algorithm, extra) in enumerate([("torus2d", {}), ("torus2d", {"impl": "p2p"}), ("hierarchical", {}),
                                               ("hierarchical", {"impl": "p2p", "inter": "ring"})]):
        _check(p, rank, 4099, 900 + case, algorithm, mesh=mesh, **extra)
    assert CommHookState("torus2d", mesh=mesh).grid == f"{local_world}x{nodes}"
    assert CommHookState("hierarchical", mesh=mesh).local_size == local_world
    x = torch.ones(8)
    swapped = DeviceMesh("cpu", torch.arange(p).reshape(nodes, local_world).t().contiguous())
    for call, fragment in (
            (lambda: comm.allreduce(x, "torus2d", mesh=swapped), "in row-major order"),
            (lambda: comm.allreduce(x, "hierarchical", mesh=mesh["local"]), "has 1 dimension(s)"),
            (lambda: comm.allreduce(x, "torus2d", mesh=mesh, grid=f"{p}x1"), "disagree"),
            (lambda: comm.allreduce(x, "hierarchical", mesh=mesh, local_size=p), "disagree"),
            (lambda: comm.allreduce(x, "ring", mesh=mesh), "do not apply to algorithm ring"),
            (lambda: comm.allreduce(x, "torus2d", mesh="2x2"), "not a DeviceMesh")):
        with pytest.raises(UserError, match=re.escape(fragment)):
            call()


def _check_ddp(p: int, rank: int, two_levels: bool = False) -> None:
    """Every hook gives DDP's own averaged gradients (2 iterations: first bucket, then rebuilt small buckets).
    ``two_levels`` (4 ranks): only the native-composed hooks on a 2x2 layout, where both levels are real, so the
    whole future chain runs (in-node reduce-scatter, cross all-reduce or p2p, in-node all-gather)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from largebatch.comm.hook import CommHookState

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3),
                                   torch.nn.Flatten(), torch.nn.Linear(128, 10))

    def grads(hook: str | None, compression: str = "none", **extra) -> list[list[torch.Tensor]]:
        net = DDP(model(), bucket_cap_mb=0.002)
        fast_path_off = {} if hook in (None, "noop", "native") else {"small_bytes": 0}   # tiny buckets: run the algorithm
        pieces = {"pipeline": 2} if extra.get("impl") == "p2p" else {}   # the native hook overlaps whole buckets
        if hook == "torus2d":                            # one rank per row: the column step is the whole world,
            fast_path_off.update(grid=f"1x{p}", **pieces)   # pipelined on the cross-level worker thread
        if hook == "hierarchical":                       # one rank per "node", likewise
            fast_path_off.update(local_size=1, **pieces)
        fast_path_off.update(extra)
        state = comm.register(net, comm.CommHookState(hook, compression=compression, **fast_path_off)) if hook else None
        if state is not None and hook != "noop":         # the backend's own collectives need no thread
            assert (state._thread is None) == state.chained, (hook, extra)
            impl = extra.get("impl", DEFAULT_IMPL) if hook in TWO_LEVEL else None
            assert state.chained == (hook == "native" or impl == "native"), (hook, extra)
        out = []
        for it in range(2):
            g = torch.Generator().manual_seed(100 * it + rank)
            x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
            net.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            out.append([q.grad.clone() for q in net.parameters()])
        if state is not None:
            blob = pickle.dumps(state)                      # state pickles without its groups/thread
            back = pickle.loads(blob)
            assert isinstance(back, CommHookState) and back.algorithm == hook and back.compression == compression
            assert back.process_group is None and back._thread is None
            state.close()
        return out

    ref = grads(None)
    local = grads("noop")
    plain = model()
    for it in range(2):
        g = torch.Generator().manual_seed(100 * it + rank)
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        plain.zero_grad()
        torch.nn.functional.cross_entropy(plain(x), y).backward()
        assert all(torch.allclose(a, q.grad, rtol=1e-6, atol=1e-7) for a, q in zip(local[it], plain.parameters()))
    biggest = torch.tensor([max(float(t.abs().max()) for t in local[1] + local[0])])
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
    native_composed = [("torus2d", {"impl": "native", "grid": f"{p}x1"}),      # the row step is the world
                       ("torus2d", {"impl": "native"}),                          # 1 x p: the column step is
                       ("hierarchical", {"impl": "native", "local_size": p, "inter": "native"}),
                       ("hierarchical", {"impl": "native", "inter": "halving_doubling"})]
    p2p_forms = [(a, {"impl": "p2p"}) for a in TWO_LEVEL]                       # on the communication thread
    forms = [(a, {}) for a in comm.ALGORITHMS] + p2p_forms + native_composed
    if two_levels:
        forms = [("torus2d", {"grid": "2x2"}), ("hierarchical", {"local_size": 2, "inter": "native"}),
                 ("hierarchical", {"local_size": 2, "inter": "halving_doubling"})]
    for algorithm, extra in forms:
        for compression in COMPRESSIONS:
            got = grads(algorithm, compression, **extra)
            atol = 1e-6 if compression == "none" else (p + 3) * UNIT_ROUNDOFF[compression] * float(biggest)
            for it in range(2):
                for a, b in zip(got[it], ref[it]):
                    assert torch.allclose(a, b, rtol=1e-5 if compression == "none" else 0, atol=atol), \
                        f"DDP {algorithm} {extra}/{compression} iteration {it}: max diff {float((a - b).abs().max()):.3g}"
                    assert _same_on_all_ranks(a), f"DDP {algorithm} {extra}/{compression}: replicas differ"


def _check_errors(p: int, rank: int) -> None:
    x = torch.ones(10)
    for call, needle in [
        (lambda: comm.allreduce(x, "torus2d", grid="3x2"), "comm.grid is 3x2 .6 positions. but the group size is"),
        (lambda: comm.allreduce(x, "torus2d", grid="4"), "not of the form"),
        (lambda: comm.allreduce(x, "hierarchical", local_size=3),
         "comm.local_size is 3, which does not divide the group size"),
        (lambda: comm.allreduce(x, "ring", grid="2x2"), "do not apply"),
        (lambda: comm.allreduce(x, "hierarchical", pipeline=0), "pipeline=0"),
        (lambda: comm.allreduce(x, "ring", pipeline=2), "do not apply"),
        (lambda: comm.allreduce(x, "torus2d", impl="nccl"), "impl='nccl' is unknown"),
        (lambda: comm.allreduce(x, "ring", impl="native"), "do not apply"),
        (lambda: comm.allreduce(torch.ones(3, dtype=torch.int32), "ring", compression="fp16"), "floating-point"),
    ]:
        with pytest.raises(UserError, match=needle):
            call()
    assert torch.equal(x, torch.ones(10))


def _groups(p: int, local_world: int) -> dict[str, Callable[[int], None]]:
    """Every check of world size `p`, in the order the ranks run them, named by algorithm and layout: one pytest
    case each (`test_allreduce`). A group is a function of the rank; the case numbers seed the inputs."""
    groups: dict[str, Callable[[int], None]] = {}
    counter = itertools.count(1)

    def add(name: str, calls: list[tuple[tuple, dict]]) -> None:
        def run(rank: int) -> None:
            for args, kwargs in calls:
                _check(p, rank, *args, **kwargs)
        groups[name] = run

    lengths = sorted({1, max(1, p - 1), p + 1, 1009, 262147})    # 262147 floats ~ 1 MB, prime
    for algorithm, impl in [(a, {}) for a in comm.ALGORITHMS] + [(a, {"impl": "p2p"}) for a in TWO_LEVEL]:
        calls = []                                   # torus2d and hierarchical: the default (native), and p2p
        for compression in COMPRESSIONS:
            for n in lengths:
                if compression != "none" and (n > 100_000 or (p >= 6 and n != 1009)):
                    continue                            # runtime: lossy at 1 MB never, at p >= 6 on 1009 only
                calls.append(((n, next(counter), algorithm, compression), impl))
        add(f"{algorithm}{':' + impl['impl'] if impl else ''} lengths x compressions", calls)
    for grid in GRIDS[p]:
        calls = [((n, next(counter), "torus2d"), {"grid": grid, "impl": "p2p"}) for n in (p + 1, 1009, 65537)]
        case = calls[-1][0][1]
        calls.append(((4099, case, "torus2d", "fp16"), {"grid": grid, "impl": "p2p"}))
        for pieces in (3, 7):                       # pipelined: pieces of 65537 elements, and more pieces than some chunks
            case = next(counter)
            calls.append(((65537 if pieces == 3 else p + 1, case, "torus2d"),
                          {"grid": grid, "pipeline": pieces, "impl": "p2p"}))
        calls.append(((4099, case, "torus2d", "bf16"), {"grid": grid, "pipeline": 3, "impl": "p2p"}))
        add(f"torus2d:p2p grid {grid}", calls)
    for k in LOCAL_SIZES[p]:
        calls = []
        for inter in ("halving_doubling", "ring", "native"):
            calls.append(((1009, case := next(counter), "hierarchical"),
                          {"local_size": k, "inter": inter, "impl": "p2p"}))
        calls.append(((4099, case, "hierarchical", "bf16"), {"local_size": k, "impl": "p2p"}))
        for inter in ("halving_doubling", "native"):
            calls.append(((65537, case := next(counter), "hierarchical"),
                          {"local_size": k, "inter": inter, "pipeline": 4, "impl": "p2p"}))
        calls.append(((4099, case, "hierarchical", "fp16"), {"local_size": k, "pipeline": 3, "impl": "p2p"}))
        add(f"hierarchical:p2p local_size {k}", calls)
    # native-composed two-level forms (the backend's reduce-scatter / all-reduce / all-gather)
    for grid in GRIDS[p]:
        calls = []
        for n, pieces in ((p + 1, 1), (65537, 1), (65537, 3), (p + 1, 7)):
            calls.append(((n, case := next(counter), "torus2d"), {"grid": grid, "impl": "native", "pipeline": pieces}))
        calls += [((4099, case, "torus2d", "fp16"), {"grid": grid, "impl": "native", "pipeline": 2}),
                  ((4099, case, "torus2d", "bf16"), {"grid": grid, "impl": "native"}),
                  ((1009, case, "torus2d"), {"grid": grid, "impl": "native", "dtype": torch.int64})]
        add(f"torus2d:native grid {grid}", calls)
    for k in LOCAL_SIZES[p]:
        calls = []
        for inter in ("native", "halving_doubling", "ring"):
            for n, pieces in ((1009, 1), (65537, 3)):
                calls.append(((n, case := next(counter), "hierarchical"),
                              {"local_size": k, "inter": inter, "impl": "native", "pipeline": pieces}))
        calls.append(((4099, case, "hierarchical", "fp16"), {"local_size": k, "impl": "native", "inter": "native"}))
        add(f"hierarchical:native local_size {k}", calls)
    for algorithm in comm.ALGORITHMS:
        add(f"{algorithm} int32 int64 float64", [((1009, next(counter), algorithm), {"dtype": dtype})
                                                 for dtype in (torch.int32, torch.int64, torch.float64)])
    groups["small-message fast path and a non-contiguous tensor"] = lambda rank: _check_fast_path(p, rank)
    if local_world < p:
        groups[f"DeviceMesh {p // local_world}x{local_world}"] = lambda rank: _check_mesh(p, rank, local_world)
    if p == 4:
        groups["option errors"] = lambda rank: _check_errors(p, rank)
    if p in (2, 3):
        groups["DDP hooks"] = lambda rank: _check_ddp(p, rank)
    if p == 4:
        groups["DDP hooks on two levels 2x2"] = lambda rank: _check_ddp(p, rank, two_levels=True)
    return groups


def _check_fast_path(p: int, rank: int) -> None:
    """The small-message fast path hands small tensors to native: bit-identical to it; a non-contiguous tensor is
    reduced in place too."""
    x = _inputs(p, 1009, 7, torch.float32)[rank]
    ref = comm.allreduce(x.clone(), "native")
    for algorithm in [a for a in comm.ALGORITHMS if a != "native"]:
        assert torch.equal(comm.allreduce(x.clone(), algorithm, small_bytes=4036 + 1), ref), algorithm
    m = torch.arange(12.0).reshape(3, 4).t() * (rank + 1)
    comm.allreduce(m, "ring")
    assert torch.equal(m, torch.arange(12.0).reshape(3, 4).t() * sum(range(1, p + 1)))


def _worker(rank: int, p: int, port: int, local_world: int, out: str) -> None:
    """Run every group in order and write {group: "ok" or the failure} to OUT/RANK.json. The first failure ends
    the run (the ranks would no longer meet in the same collectives): the later groups are "not run"."""
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=p,
                            timeout=datetime.timedelta(seconds=120))
    results: dict[str, str] = {}
    failed = None
    for name, group in _groups(p, local_world).items():
        if failed is not None:
            results[name] = f"not run: group {failed!r} failed before it"
            continue
        try:
            group(rank)
            results[name] = "ok"
        except Exception:   # noqa: BLE001 - the failure is this case's report
            results[name], failed = traceback.format_exc(limit=4), name
    if failed is None:
        dist.barrier()
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    if failed is None:
        dist.destroy_process_group()
    end_process(0, ran_group=True)   # exit without interpreter finalization while gloo threads live (largebatch.dist)


LAYOUTS = [(2, 2), (3, 3), (4, 2), (6, 3), (8, 4)]   # world, processes per node (LOCAL_WORLD_SIZE)
# The 23 ranks of the five worlds are forked from one server that has imported torch and this module once
# (multiprocessing's forkserver, started at the first world): spawned, each rank imported them itself, about 4 s of
# CPU apiece (test_comm.py: 72 s -> 50 s alone on 2 idle cores).
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "largebatch.comm", __name__])


@functools.lru_cache(maxsize=None)
def _run_world(world: int, local_world: int) -> dict[str, list[str]]:
    """Each world size spawned once (the first of its cases runs it): every group's outcome on every rank."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(world, _free_port(), local_world, out), nprocs=world, join=True,
                           start_method="forkserver")
        per_rank = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]
    return {name: [ranks[name] for ranks in per_rank] for name in per_rank[0]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, local_world, group", [(w, k, g) for w, k in LAYOUTS for g in _groups(w, k)],
                         ids=[f"p{w}-{g.replace(' ', '_')}" for w, k in LAYOUTS for g in _groups(w, k)])
def test_allreduce(world: int, local_world: int, group: str) -> None:
    """One algorithm and layout at one world size, on every rank: exact sums within the module's tolerances, equal
    to native, the same on all ranks. Default torus grid / node size come from LOCAL_WORLD_SIZE (2x2, 3x2, 4x2)."""
    outcome = _run_world(world, local_world)[group]
    bad = [(rank, text) for rank, text in enumerate(outcome) if text != "ok"]
    assert not bad, "\n".join(f"rank {rank}: {text}" for rank, text in bad)   # each rank's own failure
