"""largebatch evaluate of a Collapsed Ensemble on two processes."""
import json

import pytest
import yaml
from test_ensemble import _hand, _snapshots, _tiny_cfg  # the helpers of its unit tests, one copy

from largebatch import ensemble
from largebatch.data import build_data

pytestmark = pytest.mark.timeout(180)


def test_evaluate_cli_two_processes(tmp_path, cli):
    cfg = _tiny_cfg()
    _, test, info = build_data(cfg.data, cfg.train.seed)
    model, states = _snapshots(cfg, info)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    for i, st in enumerate(states):
        model.load_state_dict(st)
        ensemble.save_snapshot(model, run, step=10 * (i + 1), epoch=float(i + 1))
    proc = cli("evaluate", run, "--ensemble", "--swa", "--nproc-per-node", "2", "--batch", "5", check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    members, ens_top1, _ = _hand(cfg, states, test)
    assert out["world_size"] == 2
    assert [s["step"] for s in out["snapshots"]] == [10, 20, 30]
    assert [s["top1"] for s in out["snapshots"]] == pytest.approx(members, abs=1e-12)
    assert out["ensemble_top1"] == pytest.approx(ens_top1, abs=1e-12)
    assert 0 <= out["swa_top1"] <= 1 and json.loads((run / "evaluation.json").read_text()) == out
    assert cli("evaluate", tmp_path / "missing").returncode == 2
    assert cli("evaluate", run, "--swa").returncode == 2

