"""Single-process pieces of largebatch.comm (validation, chunking, cost model, hook state) and the bench CLI."""
from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
from conftest import ROOT

from largebatch import comm
from largebatch.comm.chunking import bounds
from largebatch.comm.hook import CommHookState
from largebatch.comm.topology import resolve_grid, resolve_local_size
from largebatch.commands.bench.allreduce import parse_sizes
from largebatch.errors import UserError
from largebatch.perf import measured as cost
from largebatch.perf.topology import Topology


@pytest.mark.parametrize("n, parts", [(0, 3), (1, 4), (5, 8), (1009, 6), (262147, 8), (12, 4)])
def test_bounds_cover_the_tensor_in_near_equal_pieces(n: int, parts: int) -> None:
    off = bounds(n, parts)
    sizes = [b - a for a, b in zip(off, off[1:])]
    assert off[0] == 0 and off[-1] == n and len(sizes) == parts
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_user_errors_name_the_problem() -> None:
    with pytest.raises(UserError, match="unknown all-reduce algorithm 'rign'"):
        comm.resolve("rign", {})
    with pytest.raises(UserError, match="unknown compression 'int8'"):
        comm.resolve("ring", {"compression": "int8"})
    with pytest.raises(UserError, match="local_size do not apply to algorithm torus2d"):
        comm.resolve("torus2d", {"local_size": 2})
    with pytest.raises(UserError, match="noop"):
        comm.resolve("noop", {})                      # hook-only
    with pytest.raises(UserError, match="inter='tree'"):
        comm.resolve("hierarchical", {"inter": "tree"})
    with pytest.raises(UserError, match="X\\*Y = 6"):
        resolve_grid("4x2", 6)
    with pytest.raises(UserError, match="XxY"):
        resolve_grid("2by3", 6)
    assert resolve_grid("3x2", 6) == (3, 2)
    with pytest.raises(UserError, match="comm.local_size is 4, which does not divide the group size 6"):
        resolve_local_size(4, 6)
    assert comm.resolve("ring", {"grid": None}).algorithm == "ring"   # None = unset (config passes all fields)


def test_hook_state_validates_and_pickles_fields_only() -> None:
    with pytest.raises(UserError, match="grid"):
        CommHookState("torus2d", grid="2x")
    state = CommHookState("hierarchical", compression="bf16", local_size=2, timeout_s=30.0)
    back = pickle.loads(pickle.dumps(state))
    assert repr(back) == repr(state) and back.process_group is None and back._thread is None


def test_cost_is_the_perf_model_on_measured_links() -> None:
    from largebatch.perf import halving_doubling, hierarchical, ring, torus2d
    from largebatch.perf.catalog import Link

    intra, inter = Link("i", 1e-3, 1e6), Link("e", 2e-3, 1e6)
    topo = cost.topology(4, 2, intra, inter, gamma=1e-9)
    n = 4000
    assert cost.predict("ring", n, topo) == ring.cost(n, topo) == cost.predict("native", n, topo)
    assert cost.predict("halving_doubling", n, topo) == halving_doubling.cost(n, topo)
    assert cost.predict("torus2d", n, topo, impl="p2p") == torus2d.cost(n, topo, 2)          # default grid K x nodes
    assert cost.predict("torus2d", n, topo, grid="4x1", impl="p2p") == torus2d.cost(n, topo, 4)
    assert cost.predict("hierarchical", n, topo, inter="ring", impl="p2p") == hierarchical.cost(n, topo, "ring")
    big = 64 << 20   # the default implementation is the native-composed one: its own pieces, queued stages
    assert cost.predict("torus2d", big, topo) == cost.predict("torus2d", big, topo, impl="native")
    assert cost.predict("torus2d", big, topo) != cost.predict("torus2d", big, topo, impl="p2p")
    # below small_bytes a p2p algorithm runs (and is predicted as) native
    assert cost.predict("halving_doubling", n, topo, small_bytes=n + 1) == ring.cost(n, topo)
    assert cost.predict("halving_doubling", n, topo, small_bytes=n) == halving_doubling.cost(n, topo)
    # one node: no inter-node link is needed
    assert cost.predict("ring", n, cost.topology(4, 4, intra, None)) == ring.cost(n, Topology(4, 4, intra, intra))
    # native as NCCL runs it: the faster of ring and tree (here, many nodes and a small message: the tree)
    from largebatch.perf import tree
    wide = cost.topology(64, 1, intra, inter)
    assert cost.predict("native", 8.0, wide, backend="nccl") == tree.cost(8.0, wide) < ring.cost(8.0, wide)


def test_the_runtime_comm_package_does_not_import_the_model() -> None:
    """One direction only: largebatch.perf models largebatch.comm; comm runs without perf."""
    from pathlib import Path

    import largebatch.comm

    for path in Path(largebatch.comm.__file__).parent.glob("*.py"):
        assert "from largebatch.perf" not in path.read_text() and "import largebatch.perf" not in path.read_text(), path


def test_fit_link_recovers_alpha_and_bandwidth() -> None:
    sizes = [1024 * 4 ** k for k in range(8)]
    for flows in (1, 2):
        times = [(50e-6 + flows * m / 2e8) * (1.02 if i % 2 else 0.98) for i, m in enumerate(sizes)]
        link = cost.fit_link("x", sizes, times, flows)
        assert abs(link.alpha_s / 50e-6 - 1) < 0.1 and abs(link.bandwidth_Bps / 2e8 - 1) < 0.05
    assert math.isclose(cost.fit_gamma([1e5, 1e6], [1e-5, 1e-4]), 1e-10)
    # Hockney: bandwidth from the large messages, latency from the small ones. Out of cache (>= 1 MB)
    # this link runs at 1e8 B/s, in cache at 4e8: the fit must give the large-message rate.
    times = [1e-3 + m / (4e8 if m < 1 << 20 else 1e8) for m in sizes]
    link = cost.fit_link("x", sizes, times)
    assert abs(link.bandwidth_Bps / 1e8 - 1) < 0.05 and abs(link.alpha_s / 1e-3 - 1) < 0.1
    assert math.isclose(cost.fit_gamma([1e5, 2e6, 8e6], [2e-6, 2e-4, 8e-4]), 1e-10)   # slope over >= 1 MB
    alpha_only = cost.fit_link("x", sizes, [1e-3] * len(sizes))         # flat times: latency only, B infinite
    assert math.isclose(alpha_only.alpha_s, 1e-3) and alpha_only.bandwidth_Bps == float("inf")


def test_small_bytes_option() -> None:
    assert dict(comm.resolve("ring", {}).options)["small_bytes"] == comm.SMALL_BYTES
    assert dict(comm.resolve("ring", {"small_bytes": 0}).options)["small_bytes"] == 0
    with pytest.raises(UserError, match="small_bytes=-1"):
        comm.resolve("torus2d", {"small_bytes": -1})
    with pytest.raises(UserError, match="do not apply to algorithm native"):
        comm.resolve("native", {"small_bytes": 10})
    state = CommHookState("ring", small_bytes=0)
    assert pickle.loads(pickle.dumps(state)).small_bytes == 0


def test_parse_sizes() -> None:
    assert parse_sizes("4KB:64KB") == [4096, 16384, 65536]
    assert parse_sizes("1MB:8MB:2") == [1 << 20, 2 << 20, 4 << 20, 8 << 20]
    assert parse_sizes("100,1K") == [100, 1024]
    with pytest.raises(UserError):
        parse_sizes("4XB")






def test_pipelined_timeline() -> None:
    """The two-level pipeline's timeline: one piece is the three stages in a row; with a dominant cross
    stage the in-node stages hide behind it except for one piece's fill and drain."""
    from largebatch.comm.pipeline import pieces_for
    from largebatch.perf import hierarchical
    from largebatch.perf.catalog import Link
    from largebatch.perf.topology import pipelined

    assert pipelined(1.0, 2.0, 3.0, 1) == 6.0
    assert pipelined(1.0, 10.0, 1.0, 4) == 1.0 + 4 * 10.0 + 1.0           # cross-bound: fill + 4 x cross + drain
    assert pipelined(5.0, 1.0, 5.0, 4) == 4 * 5.0 + 4 * 5.0                # in-node bound: the cross stage hides
    fast, slow = Link("i", 0.0, 1e9), Link("e", 0.0, 1e8)
    two_nodes = Topology(4, 2, fast, slow)
    n = 64e6
    assert hierarchical.cost(n, two_nodes, pieces=8) < hierarchical.cost(n, two_nodes, pieces=1)
    one_node = Topology(4, 4, fast, fast)                                    # no cross level: pieces ignored
    assert hierarchical.cost(n, one_node, pieces=8) == hierarchical.cost(n, one_node, pieces=1)
    assert pieces_for(None, 64 << 20, "p2p") == 8 and pieces_for(None, 1 << 20, "p2p") == 1
    # queued pieces (the native-composed form's work handles) pay each stage's latency once
    from largebatch.perf.topology import staged

    def stages(b: float) -> tuple[float, float, float]:
        return 1.0 + b, 2.0 + 10 * b, 1.0 + b                               # latency + bytes
    assert staged(stages, 8.0, 1, queued=True) == staged(stages, 8.0, 1) == pipelined(9.0, 82.0, 9.0, 1)
    assert staged(stages, 8.0, 4) == pipelined(3.0, 22.0, 3.0, 4)
    assert staged(stages, 8.0, 4, queued=True) == pipelined(2.0, 20.0, 2.0, 4) + 4.0
    assert staged(stages, 8.0, 32, queued=True) < staged(stages, 8.0, 32)
    slow_latency = Topology(4, 2, Link("i", 1e-3, 1e9), Link("e", 1e-3, 1e8))
    assert (hierarchical.cost(n, slow_latency, "native", pieces=32, queued=True)
            < hierarchical.cost(n, slow_latency, "native", pieces=32))
    assert pieces_for(3, 1 << 20, "p2p") == 3
    # the native-composed form: smaller pieces (work handles, no Python round trip per piece)
    assert pieces_for(None, 16 << 20, "native") == 16 and pieces_for(None, 1 << 30, "native") == 32
    assert pieces_for(None, 512 << 10, "native") == 1 and pieces_for(3, 16 << 20, "native") == 3


def test_a_comm_config_section_is_the_hook_options() -> None:
    """CommHookState.from_config(cfg.comm): the section's set fields become the hook's validated options, nothing
    else; install() leaves native uncompressed to DDP's own all-reduce (no hook)."""
    from largebatch import config
    from largebatch.comm.hook import CommHookState

    cfg = config.load("fashion_mnist", ["comm.algorithm=hierarchical", "comm.impl=native", "comm.inter=native",
                                        "comm.local_size=2", "comm.compression=bf16"])
    state = CommHookState.from_config(cfg.comm)
    assert (state.algorithm, state.compression, state.timeout_s) == ("hierarchical", "bf16", cfg.comm.timeout_s)
    assert state.options == {"grid": None, "pipeline": None, "impl": "native", "local_size": 2, "inter": "native",
                             "small_bytes": None}
    assert dict(state.spec.options)["impl"] == "native" and state.chained and state.local_size == 2
    assert pickle.loads(pickle.dumps(state)).options == state.options
    assert CommHookState.needed(cfg.comm)
    assert not CommHookState.needed(config.load("fashion_mnist", ["comm.algorithm=native"]).comm)
    assert CommHookState.needed(config.load("fashion_mnist", ["comm.algorithm=native", "comm.compression=fp16"]).comm)
    bad = config.CommConfig(algorithm="ring", impl="native")   # config.load refuses it (CommConfig.validate)
    with pytest.raises(UserError, match="do not apply to algorithm ring"):
        CommHookState.from_config(bad)


def test_one_table_of_comm_options() -> None:
    """largebatch.comm.options.OPTIONS is the one list: the config section's option keys, the hook state's fields
    and dispatch's per-algorithm defaults all come from it."""
    from largebatch import comm, config
    from largebatch.comm import options as algorithms
    from largebatch.comm.hook import CommHookState

    own = {"algorithm", "compression", "bucket_mb", "timeout_s"}
    assert {f.name for f in dataclasses.fields(config.CommConfig)} == own | set(algorithms.OPTIONS)
    assert set(CommHookState.FIELDS) == own - {"bucket_mb"} | set(algorithms.OPTIONS)
    for name in algorithms.ALLREDUCE:
        assert comm.OPTIONS[name] == {k: o.default for k, o in algorithms.OPTIONS.items() if name in o.algorithms}
    assert comm.OPTIONS["native"] == {} and comm.OPTIONS["torus2d"]["impl"] == algorithms.DEFAULT_IMPL
    with pytest.raises(TypeError, match="unknown option"):
        CommHookState("ring", pieces=2)


@pytest.mark.parametrize("sets, match", [
    (["comm.algorithm=torus2d", "comm.pipeline=4"], "comm.pipeline is 4 but torus2d's native implementation"),
    (["comm.algorithm=hierarchical", "comm.impl=native", "comm.pipeline=2"], "remove comm.pipeline"),
])
def test_pipeline_is_read_or_refused(sets: list[str], match: str) -> None:
    """comm.pipeline is read by the p2p hook (pieces of a bucket) and refused for the native-composed hook, which
    chains whole buckets: never accepted and ignored."""
    from largebatch import config
    from largebatch.comm.hook import CommHookState

    with pytest.raises(UserError, match=match):
        config.load("fashion_mnist", sets)
    with pytest.raises(UserError, match="pipeline is"):
        CommHookState(sets[0].split("=")[1], pipeline=4)
    cfg = config.load("fashion_mnist", [sets[0], "comm.impl=p2p", "comm.pipeline=4"])
    assert dict(CommHookState.from_config(cfg.comm).spec.options)["pipeline"] == 4




def test_register_takes_one_state_and_the_pipeline_default_is_said_as_the_code_has_it() -> None:
    """`comm.register(ddp, state)` is the one entry point: a name, a config section or options are a TypeError
    naming how to build the state. The pipeline's default pieces are one table (`algorithms.PIECES`) that
    `pieces_for`, the option's documentation, dispatch's error and docs/communication.md all say."""
    import torch

    from largebatch.comm import options as algorithms
    from largebatch.comm.pipeline import pieces_for

    for wrong in ("ring", CommHookState):
        with pytest.raises(TypeError, match=r"CommHookState\(algorithm, \*\*options\) or CommHookState.from_config"):
            comm.register(torch.nn.Linear(2, 2), wrong)  # type: ignore[arg-type]
    for impl, (size, most) in algorithms.PIECES.items():
        assert pieces_for(None, 3 * size, impl) == 3 and pieces_for(None, 1000 * most * size, impl) == most
        said = f"one piece per {size >> 20} MB (at most {most}) for {impl}"
        assert said in algorithms.OPTIONS["pipeline"].doc
        row = next(line for line in (ROOT / "docs/communication.md").read_text().splitlines()
                   if line.startswith("| `pipeline=N`"))
        assert f"one per {size >> 20} MB (at most {most}) for `{impl}`" in row
    with pytest.raises(UserError, match="or left unset for the default: one piece per 4 MB"):
        comm.resolve("torus2d", {"pipeline": 0})
