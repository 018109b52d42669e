"""largebatch evaluate of a Collapsed Ensemble on two processes."""
import json

import pytest
import torch
import yaml

from largebatch import ensemble
from largebatch.config import Config
from largebatch.data import build_data
from largebatch.models.classifier import build_classifier

pytestmark = pytest.mark.timeout(180)


def _tiny_cfg() -> Config:
    cfg = Config()
    cfg.data.dataset, cfg.data.synthetic_size, cfg.data.image_size, cfg.data.num_classes = "synthetic", 256, 8, 4
    cfg.model.width = 4
    cfg.train.plots = False
    return cfg


def _snapshots(cfg, info, n=3):
    states = []
    for seed in range(n):
        torch.manual_seed(100 + seed)
        model = build_classifier(cfg.model, info)
        for p in model.parameters():   # random weights everywhere (zero-init gammas would make members alike)
            p.data.normal_(0, 0.5)
        states.append(model.state_dict())
    return model, states


def _hand(cfg, states, test, flip=False):
    """Softmax of every member on every test image (with `flip`: of the logits averaged over the image and its
    mirror), averaged; top-1 by argmax, NLL of the average."""
    x, y = next(test.batches([torch.arange(len(test))], train=False, epoch=0))
    probs = []
    for st in states:
        m = build_classifier(cfg.model, _info(cfg))
        m.load_state_dict(st)
        m.eval()
        with torch.no_grad():
            logits = (m(x) + m(x.flip(3))) / 2 if flip else m(x)
            probs.append(logits.softmax(1))
    avg = torch.stack(probs).mean(0)
    member_top1 = [(p.argmax(1) == y).double().mean().item() for p in probs]
    return member_top1, (avg.argmax(1) == y).double().mean().item(), -avg[torch.arange(len(y)), y].log().mean().item()


def _info(cfg):
    return build_data(cfg.data, cfg.train.seed)[2]


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

