"""Single-process pieces of largebatch.comm (validation, chunking, cost model, hook state) and the bench CLI."""
from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys

import pytest

from largebatch import comm
from largebatch.bench.allreduce import parse_sizes
from largebatch.comm import cost
from largebatch.comm.chunking import bounds
from largebatch.comm.hook import CommHookState
from largebatch.comm.topology import resolve_grid, resolve_local_size
from largebatch.errors import UserError


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
    with pytest.raises(UserError, match="local_size=4"):
        resolve_local_size(4, 6)
    assert comm.resolve("ring", {"grid": None}).algorithm == "ring"   # None = unset (config passes all fields)


def test_hook_state_validates_and_pickles_fields_only() -> None:
    with pytest.raises(UserError, match="grid"):
        CommHookState("torus2d", grid="2x")
    state = CommHookState("hierarchical", compression="bf16", local_size=2, timeout_s=30.0)
    back = pickle.loads(pickle.dumps(state))
    assert repr(back) == repr(state) and back.process_group is None and back._thread is None


def test_cost_formulas_and_fit() -> None:
    n = 64 << 20
    for p in (4, 8):          # torus2d and hierarchical move the ring's bytes (Mikami et al.)
        ring_b = cost.coefficients("ring", p, n)[1]
        assert math.isclose(cost.coefficients("torus2d", p, n, grid=f"2x{p // 2}")[1], ring_b)
        assert math.isclose(cost.coefficients("hierarchical", p, n, local_size=2, inter="ring")[1], ring_b)
    assert cost.coefficients("torus2d", 8, n, grid="4x2")[0] == 2 * 3 + 2 * 1
    assert cost.coefficients("halving_doubling", 8, n)[0] == 6
    a6, b6 = cost.coefficients("halving_doubling", 6, n)        # fold + unfold on top of p2 = 4
    assert a6 == 2 * 2 + 2 and math.isclose(b6, 1.5 * n + 2 * n)
    sizes = [4096 * 4 ** k for k in range(8)]
    for name, layout in (("ring", {}), ("halving_doubling", {}), ("torus2d", {"grid": "2x2"})):
        times = [cost.predict(name, 4, s, 50e-6, 1e-9, **layout) * (1.02 if i % 2 else 0.98)
                 for i, s in enumerate(sizes)]
        alpha, beta = cost.fit(name, 4, sizes, times, **layout)
        assert abs(alpha / 50e-6 - 1) < 0.05 and abs(beta / 1e-9 - 1) < 0.05


def test_parse_sizes() -> None:
    assert parse_sizes("4KB:64KB") == [4096, 16384, 65536]
    assert parse_sizes("1MB:8MB:2") == [1 << 20, 2 << 20, 4 << 20, 8 << 20]
    assert parse_sizes("100,1K") == [100, 1024]
    with pytest.raises(UserError):
        parse_sizes("4XB")


@pytest.mark.timeout(180)
def test_bench_cli_runs_two_workers(tmp_path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = subprocess.run([sys.executable, "-m", "largebatch", "bench", "allreduce", "--nproc", "2",
                           "--sizes", "4KB,64KB", "--iters", "2", "--warmup", "1", "--algorithms", "ring",
                           "halving_doubling", "--json", str(out), "--plot", str(png)],
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert {(r["algorithm"], r["bytes"]) for r in data["rows"]} == {
        (a, b) for a in ("native", "ring", "halving_doubling") for b in (4096, 65536)}
    for r in data["rows"]:
        assert r["time_s"] > 0 and math.isclose(r["busbw_GBps"], r["algbw_GBps"] * 2 * (2 - 1) / 2)
    assert set(data["fits"]) == {"native", "ring", "halving_doubling"}
    assert png.stat().st_size > 1000 and "busbw(GB/s)" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "largebatch", "bench", "allreduce", "--algorithms", "rign"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "rign" in bad.stderr and "Traceback" not in bad.stderr
