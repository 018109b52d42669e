"""largebatch bench allreduce on real worker processes."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import run_cli


@pytest.mark.timeout(180)
def test_bench_cli_runs_two_workers(tmp_path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = run_cli("bench", "allreduce", "--nproc", "2", "--sizes", "4KB,64KB", "--iters", "2", "--warmup", "1",
                   "--algorithms", "ring", "halving_doubling", "--json", out, "--plot", png, timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    # written by a worker (forked from the launch's forkserver): the command as the user gave it, less --nproc
    assert data["command"].startswith("largebatch bench allreduce --sizes 4KB,64KB --iters 2"), data["command"]
    assert {(r["algorithm"], r["bytes"]) for r in data["rows"]} == {
        (a, b) for a in ("native", "ring", "halving_doubling") for b in (4096, 65536)}
    for r in data["rows"]:
        assert r["time_s"] > 0 and math.isclose(r["busbw_GBps"], r["algbw_GBps"] * 2 * (2 - 1) / 2)
    assert set(data["fits"]) == {"native", "ring", "halving_doubling"}
    assert data["links"]["intra"]["bandwidth_Bps"] > 0 and data["links"]["gamma_s_per_byte"] > 0
    assert all(r["predicted_s"] > 0 and r["median_s"] > 0 for r in data["rows"])
    assert png.stat().st_size > 1000 and "busbw(GB/s)" in proc.stdout
    bad = run_cli("bench", "allreduce", "--algorithms", "rign", timeout=60)
    assert bad.returncode == 2 and "rign" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.timeout(240)
def test_bench_native_composed_and_training_keys(tmp_path) -> None:
    """torus2d:native / hierarchical:native run beside native; --training writes exposed_ms per hook and ddp_exposed_ms."""
    out = tmp_path / "r.json"
    base = [sys.executable, "-m", "largebatch", "bench", "allreduce", "--nproc", "2", "--iters", "2", "--warmup", "1",
            "--rounds", "1"]
    proc = subprocess.run(base + ["--sizes", "1MB", "--small-bytes", "0", "--algorithms", "torus2d:native",
                                  "hierarchical:native", "--json", str(out)], capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["algorithm"] for r in rows} == {"native", "torus2d:native", "hierarchical:native"}
    assert all(r["busbw_GBps"] > 0 and r["predicted_s"] > 0 for r in rows)
    proc = subprocess.run(base + ["--training", "--steps", "1", "--width", "4", "--batch", "2", "--algorithms",
                                  "torus2d:native", "--json", str(out)], capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data["exposed_ms"]) == {"noop", "ddp", "torus2d:native"} and data["exposed_ms"]["noop"] == 0.0
    assert data["ddp_exposed_ms"] == data["exposed_ms"]["ddp"]

