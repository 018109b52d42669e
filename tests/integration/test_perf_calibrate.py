"""`--calibrate` measures this machine in 2 real gloo processes and the model can use the entry."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from largebatch.perf import calibrate, predict
from largebatch.perf.catalog import clear_cache, get_device, get_link


@pytest.mark.timeout(180)
def test_calibrate_writes_a_usable_this_machine_entry(tmp_path, monkeypatch):
    path = tmp_path / "this_machine.yaml"
    monkeypatch.setenv("LARGEBATCH_CATALOG", str(path))
    clear_cache()
    try:
        entries = calibrate.measure(width=4, b1=2, b2=8, reps=2, matmul_n=128, sizes=(2**10, 2**16, 2**18))
        assert calibrate.write(entries) == path and path.is_file()
        dev = get_device("this-machine", "fp32")
        link, _ = get_link("loopback")
        assert dev.peak_flops > 1e8 and 0 < dev.eff_max and dev.b_half >= 0
        assert link.bandwidth_Bps > 1e6 and link.alpha_s >= 0
        p = predict(model="resnet18", stem="small", width=4, in_channels=1, image_size=28, num_classes=10,
                    device="this-machine", devices=2, devices_per_node=2, global_batch=16, precision="fp32",
                    dataset_size=60000, epochs=1)
        assert p.comm_time_s > 0 and p.step_time_s > p.compute_time_s * 0.999
    finally:
        clear_cache()


def _live(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _spawned(pid: int) -> list[int]:
    from largebatch.commands.chaos import _descendants

    out = []
    for child in _descendants(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
        except OSError:
            pass
    return out


@pytest.mark.timeout(120)
def test_a_killed_calibration_leaves_no_measuring_worker_behind(tmp_path):
    """plan --calibrate's workers (torch.multiprocessing.spawn) outlived a SIGKILLed parent and kept both cores
    busy for half an hour; they now ask the kernel for SIGTERM when it dies."""
    proc = subprocess.Popen([sys.executable, "-m", "largebatch", "plan", "--calibrate", "--catalog-out",
                             str(tmp_path / "c.yaml"), "--model", "resnet18", "--image-size", "32", "--nproc", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline and len(workers) < 2 and proc.poll() is None:
            workers = _spawned(proc.pid)
            time.sleep(0.2)
        assert len(workers) >= 2, "the calibration's workers did not start"
        time.sleep(1.0)   # past the workers' start, into the measurement
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.time() + 30
        while time.time() < deadline and any(_live(p) for p in workers):
            time.sleep(0.2)
        assert not [p for p in workers if _live(p)], f"workers {workers} outlived the killed calibration"
        orphans = [p for p in _all_pids() if _live(p) and str(tmp_path / "c.yaml").encode() in _cmdline(p)]
        assert not orphans, f"processes {orphans} of the killed calibration are still running"
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
