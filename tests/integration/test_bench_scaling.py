"""`largebatch bench scaling`: one tiny real 1 -> 2 worker measurement, and user errors."""
import json

import pytest


@pytest.mark.timeout(420)
def test_bench_scaling_tiny_real_runs(cli, tmp_path):
    out = tmp_path / "scaling.json"
    cli("bench", "scaling", "--algorithms", "native", "--model", "speedrun", "--width", "4", "--image-size", "16",
        "--per-worker-batch", "8", "--steps", "1", "--json", out, timeout=400, check=True)
    data = json.loads(out.read_text())
    assert data["workers"] == 2 and data["single_images_per_s"] > 0
    eff = data["efficiency"]["native"]
    assert eff == pytest.approx(data["algorithms"]["native"]["images_per_s"] / (2 * data["single_images_per_s"]))
    assert data["best_algorithm"] == "native" and data["best_efficiency"] == eff and data["ceiling_efficiency"] is None


def test_bench_scaling_user_errors(cli):
    proc = cli("bench", "scaling", "--algorithms", "carrier_pigeon")
    assert proc.returncode == 2 and "carrier_pigeon" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("bench", "scaling", "--workers", "1")
    assert proc.returncode == 2 and "--workers" in proc.stderr
