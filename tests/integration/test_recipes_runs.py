"""A recipe's dry run through the command line."""
import json

import pytest

pytestmark = pytest.mark.timeout(120)


def test_dry_run_cli_prints_phases(cli):
    proc = cli("train", "imagenet_resnet50_sony_batch_control", "--dry-run", "--world-size", "2048", check=True)
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [p["global_batch"] for p in plan["phases"]] == [34816, 69632]
    assert "batch phases" in proc.stdout

