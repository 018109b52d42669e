"""`--calibrate` measures this machine in 2 real gloo processes and the model can use the entry."""
from __future__ import annotations

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
