"""`scripts/gpu_check.sh --cpu`: the CUDA check's whole sequence with tiny sizes, so the script a GPU loan
depends on keeps working between loans: the steps in their order, at most 8 files in $OUT, and the deadline
(a command killed with its process group, its partial log kept, the later steps not started)."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.timeout(600)

# The default order: the end-to-end train step right after the CUDA tests, so that a deadline that cuts the
# check cuts the data, launch and remaining CUDA tests first (docs/gpu.md's time estimate); calibrate when asked
ORDER = ["machine", "throughput", "cuda_tests", "train", "data", "launch", "more_tests"]


def gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_check(tmp_path, timeout, **env_extra):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_SCRATCH": str(tmp_path / "scratch"), "PYTHON": sys.executable,
           **env_extra}
    for knob in ("GPU_CHECK_ONLY", "GPU_CHECK_STALL", "GPU_CHECK_DEADLINE_S", "GPU_CHECK_CALIBRATE"):
        if knob not in env_extra:
            env.pop(knob, None)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    return proc, out


def files_under(out: Path) -> list[Path]:
    files = [p.relative_to(out) for p in out.rglob("*") if not p.is_dir()]
    assert len(files) <= 8, files                               # the device tool brings back 8 files at most
    assert all(len(p.parts) <= 2 for p in files), files          # and no deeper than 2 folder levels
    return files


def test_gpu_check_cpu_mode_runs_every_step(tmp_path):
    proc, out = run_check(tmp_path, timeout=580)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["mode"] == "cpu" and result["failed_steps"] == [] and result["not_run_steps"] == []
    steps = result["steps"]
    order = ORDER
    assert list(steps) == result["order"] == order
    assert all(r["status"] == "ok" for r in steps.values()), steps
    log = (out / "gpu_check.log").read_text()
    starts = [log.index(f"=== {name} (") for name in order]
    assert starts == sorted(starts)   # run in that order, not only recorded in it

    env = steps["machine"]   # the environment probe, in its own process
    assert env["torch"] and env["cuda_available"] is False and "cpu_count" in env
    assert "libnvjpeg.so.13" in env and "nvimgcodec" in env and "torchvision" in env and "timm" in env
    assert "libnvjpeg.so.13:" in (out / "env.txt").read_text()
    tests = steps["cuda_tests"], steps["more_tests"]
    assert all(t.get("skipped", 0) + t.get("passed", 0) >= 1 for t in tests)
    assert sum(t.get("skipped", 0) + t.get("passed", 0) for t in tests) >= 20   # every CUDA test ran or said why not
    cuda_log = (out / "cuda_tests.log").read_text()
    assert "-k 'graph or prefetch or decode or gpu_cache or lars'" in cuda_log
    assert "-k 'not (graph or prefetch or decode or gpu_cache or lars)'" in cuda_log
    # the library model tests stay on CPU (make test-eco): not a minute of the GPU's deadline
    assert "test_any_model" not in cuda_log and "library" not in cuda_log
    by_batch = steps["throughput"]["by_batch"]
    assert list(by_batch) == ["8"] and by_batch["8"]["images_per_s"] > 0 and by_batch["8"]["plain_images_per_s"] > 0
    assert steps["throughput"]["images_per_s"] == by_batch["8"]["images_per_s"]
    assert steps["throughput"]["bench_json"]["8"]["configs"]   # the bench JSON itself, folded in
    assert by_batch["8"]["errors"] == {} and all(by_batch["8"]["configs"].values())
    assert "--peers torchvision " in (out / "throughput.log").read_text()
    assert set(steps["data"]["loader"]) == {"cpu_0", "cpu_2"} == set(steps["data"]["bench_json"])
    assert all(r["images_per_s"] > 0 for r in steps["data"]["loader"].values())
    assert steps["train"]["steps"] == 3 and steps["train"]["data_wait_s_per_step"] >= 0
    assert [r for r in steps["train"]["metrics"] if r.get("kind") == "train"]
    launch = steps["launch"]
    assert launch["steps"] == 3 and launch["world_size"] == 1 and launch["threads_per_worker"] == 1
    # started as users start workers (torchrun's arguments, -m largebatch), with the environment stated
    assert launch["env"] == {"OMP_NUM_THREADS": "1"} and launch["cpu_count"] >= 1
    assert launch["command"].startswith("python -m largebatch.launch --nnodes 1 --nproc-per-node 1 ")
    assert " --max-restarts 1 -m largebatch train " in launch["command"]
    assert "\n$ OMP_NUM_THREADS=1 " in (out / "train.log").read_text()

    assert sorted(map(str, files_under(out))) == sorted(["gpu_check.json", "gpu_check.log", "env.txt", "throughput.log",
                                                         "cuda_tests.log", "data.log", "train.log"])
    assert all((out / f).stat().st_size > 0 for f in files_under(out))
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("gpu_check (cpu): 7 ok, 0 failed, 0 not run") and summary in log


def test_every_step_run_still_fits_eight_files():
    gc = gpu_check_module()
    assert list(gc.DEFAULT_STEPS) == ORDER and list(gc.STEPS) == [*ORDER, "calibrate"]
    assert set(gc.LOGS) == set(gc.STEPS) and gc.STEPS[-1] == "calibrate" and "calibrate" not in gc.DEFAULT_STEPS
    names = set(gc.LOGS.values()) | set(gc.OWN_FILES)
    assert len(names) <= 8 and not any("/" in n for n in names), names


def test_the_deadline_kills_a_step_keeps_its_partial_log_and_starts_no_other(tmp_path):
    # GPU_CHECK_ONLY fixes the order (machine last here); the data step stalls until the 14 s deadline kills it
    # (a step starts with 10 s left or more; gpu_check.py imports no torch: its start takes about a second)
    t0 = time.monotonic()
    proc, out = run_check(tmp_path, timeout=120, GPU_CHECK_ONLY="data,train,machine", GPU_CHECK_STALL="data",
                          GPU_CHECK_DEADLINE_S="14")
    took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert 10 < took < 25, took
    result = json.loads((out / "gpu_check.json").read_text())
    steps = result["steps"]
    assert list(steps) == result["order"] == ["data", "train", "machine"]
    assert steps["data"]["status"] == "timeout" and "killed at the deadline" in steps["data"]["error"]
    assert steps["train"]["status"] == steps["machine"]["status"] == "not run: deadline"
    assert result["failed_steps"] == ["data"] and result["not_run_steps"] == ["train", "machine"]
    log = (out / "data.log").read_text()   # the lines printed before the kill
    assert "stall: line 1" in log and "stall: line 2" in log and "killed at the deadline" in log
    # the whole process group went: the stalled command and the child it started
    pids = [int(p) for p in re.search(r"stall: line 1 pid (\d+) child (\d+)", log).groups()]
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"), pid
    assert sorted(map(str, files_under(out))) == ["data.log", "gpu_check.json", "gpu_check.log"]   # no log unrun
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("gpu_check (cpu): 0 ok, 1 failed, 2 not run"), summary


def test_gpu_check_rejects_unknown_arguments(tmp_path):
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--gpu-please"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown argument" in proc.stderr
    proc, _ = run_check(tmp_path, timeout=60, GPU_CHECK_ONLY="throughput,warp_drive")
    assert proc.returncode == 2 and "GPU_CHECK_ONLY names warp_drive" in proc.stdout + proc.stderr
