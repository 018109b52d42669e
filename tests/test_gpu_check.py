"""`scripts/gpu_check.sh --cpu`: the CUDA check's whole sequence with tiny sizes, so the script a GPU loan
depends on keeps working between loans."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.timeout(600)


def test_gpu_check_cpu_mode_runs_every_step(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_SCRATCH": str(tmp_path / "scratch"), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["mode"] == "cpu" and result["failed_steps"] == []
    steps = result["steps"]
    assert list(steps) == ["machine", "cuda_tests", "throughput", "data", "train"]   # calibrate: GPU mode only
    tests = steps["cuda_tests"]
    assert tests.get("skipped", 0) + tests.get("passed", 0) >= 10   # every CUDA test ran or said why not
    by_batch = steps["throughput"]["by_batch"]
    assert list(by_batch) == ["8"] and by_batch["8"]["images_per_s"] > 0 and by_batch["8"]["plain_images_per_s"] > 0
    assert steps["throughput"]["images_per_s"] == by_batch["8"]["images_per_s"]
    assert set(steps["data"]["loader"]) == {"cpu_0", "cpu_2"}
    assert all(r["images_per_s"] > 0 for r in steps["data"]["loader"].values())
    assert steps["train"]["steps"] == 3 and steps["train"]["data_wait_s_per_step"] >= 0
    assert (out / "gpu_check.log").stat().st_size > 0


def test_gpu_check_rejects_unknown_arguments():
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--gpu-please"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown argument" in proc.stderr
