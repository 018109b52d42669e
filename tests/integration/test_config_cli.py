"""Bad config, data and command lines through the real command line (a subprocess): one sentence, exit 2, nothing lost."""
import gzip
import json

from conftest import fmnist_copy
from test_config import _assert_user_error  # the helpers of its unit tests, one copy


def test_cli_bad_inputs(cli, tmp_path):
    _assert_user_error(cli("train", "no_such_recipe", "--dry-run"), "no recipe named 'no_such_recipe'")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  name: [resnet18\n")
    _assert_user_error(cli("train", bad_yaml, "--dry-run"), "not valid YAML", "line")
    _assert_user_error(cli("train", "--set", "model.nme=resnet18", "--dry-run"), "unknown key model.nme")
    _assert_user_error(cli("train", "--set", "optim.lr=-1", "--dry-run"), "optim.lr is -1.0")
    _assert_user_error(cli("train", "--set", "train.seed=1.5", "--dry-run"), "train.seed must be a whole number")
    _assert_user_error(cli("train", "--set", "batch.global_batch=510", "--dry-run", "--world-size", "4"),
                       "not divisible by the world size 4")
    _assert_user_error(cli("train", "--set", "batch.accumulation=3", "--dry-run", "--world-size", "2"),
                       "accumulation")
    _assert_user_error(cli("train", "--nproc-per-node", "two"), "invalid int value")
    _assert_user_error(cli("bogus"), "unknown command")


def test_missing_and_truncated_dataset(cli, tmp_path):
    _assert_user_error(cli("train", "--set", f"data.root={tmp_path / 'nowhere'}", "--dry-run"),
                       "apt-get install -y dataset-fashion-mnist")
    root = fmnist_copy(tmp_path / "fm")
    data = gzip.decompress((root / "train-images-idx3-ubyte.gz").read_bytes())
    (root / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(data[: len(data) // 2], compresslevel=1))
    _assert_user_error(cli("train", "--set", f"data.root={root}", "--dry-run"), "train-images-idx3-ubyte")


def test_bad_input_loses_nothing(cli, tmp_path):
    """A rejected resume leaves the run directory's checkpoints and metrics as they were."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    marker = run / "checkpoints" / "step-00000010.pt"
    marker.write_bytes(b"precious")
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 10}) + "\n")
    before = sorted((p.name, p.read_bytes()) for p in run.rglob("*") if p.is_file())
    _assert_user_error(cli("train", "--run-dir", run, "--resume", "--set", "optim.momentum=1.5"), "optim.momentum")
    after = sorted((p.name, p.read_bytes()) for p in run.rglob("*") if p.is_file())
    assert before == after

