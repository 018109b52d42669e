"""`largebatch bench train`: a real (tiny) run writes consistent figures; bad command lines are user errors."""
import json

import pytest
import torch

from largebatch.commands.bench.train import (fitting_size, matmul_peak_gflops, measure, parse_config, parse_reference,
                                            peer_config)
from largebatch.errors import UserError


@pytest.mark.timeout(300)
def test_bench_train_tiny_run_writes_consistent_json(cli, tmp_path):
    out = tmp_path / "train.json"
    proc = cli("bench", "train", "--model", "speedrun", "--width", "4", "--image-size", "16", "--classes", "10",
               "--batch", "8", "--steps", "1", "--rounds", "2", "--threads", "1", "--peak-size", "128",
               "--configs", "fp32,fp32-cl", "--json", out, check=True)
    data = json.loads(out.read_text())
    for key in ("images_per_s", "plain_images_per_s", "speedup", "mfu", "peak_matmul_gflops",
                "peak_matmul_gflops_fp32", "peak_matmul_gflops_bf16", "peak_matmul_size_fp32", "peak_matmul_size_bf16", "mfu_bf16_peak", "mfu_fp32_peak"):
        assert data[key] > 0, key
    assert set(data["configs"]) == {"fp32", "fp32-cl"}
    best = data["configs"][data["best_config"]]
    assert best["images_per_s"] == max(c["images_per_s"] for c in data["configs"].values())
    assert data["speedup"] == pytest.approx(data["images_per_s"] / data["plain_images_per_s"])
    assert data["peak_matmul_gflops"] == max(data["peak_matmul_gflops_fp32"], data["peak_matmul_gflops_bf16"])
    assert data["mfu"] == pytest.approx(data["images_per_s"] * data["train_gflops_per_image"] / data["peak_matmul_gflops"])
    assert all(len(c["rounds"]) == 2 for c in data["configs"].values())
    assert "plain PyTorch" in proc.stdout and "MFU" in proc.stdout


def test_config_names_and_user_errors(cli):
    assert parse_config("bf16-cl-compile") == {"precision": "bf16", "channels_last": True, "compile": True,
                                               "graph": False}
    assert parse_config("fp32") == {"precision": "fp32", "channels_last": False, "compile": False, "graph": False}
    assert peer_config("fp16-cl-compile-graph") == "fp16-cl-compile" and peer_config("bf16-cl") == "bf16-cl"
    assert parse_config("bf16-cl-autotune")["compile"] == "max-autotune-no-cudagraphs"
    for bad in ("fp8", "fp32-nhwc", "fp32-cl-cl", "fp32-compile-autotune"):
        with pytest.raises(UserError):
            parse_config(bad)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="graph needs a CUDA device"):
            parse_config("bf16-cl-graph")
    assert parse_reference("mlperf-v4.0-h200=7951") == ("mlperf-v4.0-h200", 7951.0)
    assert parse_reference(None) is None
    for bad in ("7951", "mlperf=", "mlperf=-3", "mlperf=fast"):
        with pytest.raises(UserError, match="--reference is"):
            parse_reference(bad)
    proc = cli("bench", "train", "--configs", "fp32-fast")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "fp32-fast" in proc.stderr
    proc = cli("bench", "train", "--model", "vgg")
    assert proc.returncode == 2 and "vgg" in proc.stderr


def test_matmul_peak_is_a_real_measurement(one_thread):
    # One intra-op thread: beside other work on 2 cores, a 64^3 product on 2 OpenMP threads waits for the
    # descheduled one at every barrier and measured 0.004-0.011 GFLOP/s (a scheduler slice per product) where
    # 1 thread measured 57; the suite once failed here (2026-11-25, AVX2 EPYC, beside a 2-worker training).
    assert 0.01 < matmul_peak_gflops(__import__("torch").float32, 64, min_time_s=0.01) < 1e5


def test_a_slow_dtype_is_measured_at_a_size_that_fits_the_time():
    # bf16 on AVX2 ran 0.3 GFLOP/s: one 2048^3 product took a minute, and the peak two of them.
    import torch

    assert fitting_size(torch.float32, 2048, min_time_s=1e-9) == 256     # nothing fits: the probe's size
    assert fitting_size(torch.float32, 2048, min_time_s=1e9) == 2048     # everything fits: as asked
    assert fitting_size(torch.float32, 128, min_time_s=1e-9) == 128      # below the probe: as asked
    assert 256 <= fitting_size(torch.bfloat16, 2048, min_time_s=0.5) <= 2048


@pytest.mark.timeout(120)
def test_the_largebatch_entry_cycles_staged_batches_in_the_models_layout_and_never_changes_them(tmp_path, one_thread):
    import argparse

    import torch

    from largebatch.commands.bench.train import largebatch_step_fn

    args = argparse.Namespace(model="speedrun", width=4, image_size=16, classes=10, batch=8, optimizer="sgd",
                              threads=1)
    step = largebatch_step_fn(args, parse_config("fp32-cl"), tmp_path / "run")
    staged = step.parts.staged
    assert len(staged) == 2 and all(x.shape == (8, 3, 16, 16) and x.dtype == torch.uint8 for x, _ in staged)
    assert all(x.is_contiguous(memory_format=torch.channels_last) for x, _ in staged)
    assert not torch.equal(staged[0][0], staged[1][0])   # two different batches, not one repeated
    before = [(x.clone(), y.clone()) for x, y in staged]
    for _ in range(3):
        step()
    assert all(torch.equal(x, x0) and torch.equal(y, y0) for (x, y), (x0, y0) in zip(staged, before))


@pytest.mark.timeout(300)
def test_one_failing_entry_leaves_the_others_their_figures(tmp_path, monkeypatch, capsys, one_thread):
    # A -graph capture that fails at warm-up, an entry that fails in its second round and one that cannot be
    # built stood for every entry of the run: each now has its error in one line, the others their figures, and
    # the command exits 1 after writing the table and the JSON.
    from largebatch.commands.bench import train as bench_train

    real = bench_train.largebatch_step_fn
    calls = {"late": 0}

    def step_fn(args, spec, run_dir, device=torch.device("cpu")):
        if spec["precision"] == "bf16" and not spec["channels_last"]:
            raise RuntimeError("no trainer for you\nsecond line")
        step = real(args, spec, run_dir, device)
        if spec == parse_config("fp32-cl"):   # as a failed capture: at its first step, the warm-up
            def capture_fails():
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore lines")
            return capture_fails
        if spec == parse_config("bf16-cl"):   # its warm-up step and first round pass; its second round fails
            def late():
                calls["late"] += 1
                if calls["late"] > 2:
                    raise ValueError("a late failure")
                step()
            return late
        return step

    monkeypatch.setattr(bench_train, "largebatch_step_fn", step_fn)
    out = tmp_path / "train.json"
    rc = bench_train.main(["--model", "speedrun", "--width", "4", "--image-size", "16", "--classes", "10", "--batch",
                           "8", "--steps", "1", "--rounds", "2", "--threads", "1", "--peak-size", "64", "--configs",
                           "fp32,fp32-cl,bf16-cl,bf16", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 1
    data = json.loads(out.read_text())
    assert list(data["configs"]) == ["fp32", "fp32-cl", "bf16-cl", "bf16"]
    assert data["errors"] == {
        "fp32-cl": "RuntimeError: CUDA error: operation not permitted when stream is capturing",
        "bf16-cl": "ValueError: a late failure", "bf16": "RuntimeError: no trainer for you"}
    for name, error in data["errors"].items():
        assert data["configs"][name] == {"error": error}
        assert f"failed {name}: {error}" in captured.out
    fp32 = data["configs"]["fp32"]
    assert fp32["images_per_s"] > 0 and len(fp32["rounds"]) == 2 and fp32["speedup"] > 0
    assert data["best_config"] == "fp32" and data["images_per_s"] == fp32["images_per_s"]
    assert data["plain_images_per_s"] > 0 and data["mfu"] > 0
    assert "fp32-cl failed" in captured.out and "3 of 5 entries failed (fp32-cl, bf16-cl, bf16)" in captured.err


def test_measure_keeps_the_figures_of_entries_beside_one_that_raises():
    def broken():
        raise RuntimeError("boom")

    entries = {"a": lambda: None, "b": broken, "c": lambda: None}
    lines = []
    results = measure(entries, batch=4, steps=2, rounds=2, log=lines.append)
    assert list(results) == ["a", "b", "c"] and results["b"] == {"error": "RuntimeError: boom"}
    assert all(results[n]["images_per_s"] > 0 and len(results[n]["rounds"]) == 2 for n in "ac")
    assert "b" not in entries and "  b failed: RuntimeError: boom" in lines
