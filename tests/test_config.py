"""Config loading: recipes, --set conversion, and the bad inputs that must exit 2 with one sentence."""
import gzip
import json
import shutil

import pytest

from largebatch import config
from largebatch.errors import UserError

from conftest import FMNIST


def test_recipes_all_load():
    names = config.list_recipes()
    assert "fashion_mnist" in names
    for name in names:
        cfg = config.load(name)
        assert cfg.recipe == name


def test_set_overrides_convert_types():
    cfg = config.load("fashion_mnist", ["optim.lr=0.25", "batch.global_batch=1024", "optim.nesterov=false",
                                        "schedule.milestones=[3, 6]", "model.name=resnet34", "optim.weight_decay=0"])
    assert cfg.optim.lr == 0.25 and isinstance(cfg.optim.weight_decay, float)
    assert cfg.batch.global_batch == 1024 and cfg.optim.nesterov is False
    assert cfg.schedule.milestones == [3, 6] and cfg.model.name == "resnet34"


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=0.1", "unknown key optim.lrr (did you mean 'lr'?)"),
    ("optimizer.lr=0.1", "unknown section 'optimizer'"),
    ("batch.global_batch=big", "batch.global_batch must be a whole number"),
    ("optim.lr=-0.1", "optim.lr is -0.1; it must be positive"),
    ("optim.name=adamw", "valid values: sgd, lars, lamb"),
    ("optim.lr", "not of the form section.key=value"),
    ("data.resolution_phases=[{start_epoch: 0, size: 20}]", "data.resolution_phases[0] must be a mapping with exactly"),
    ("data.resolution_phases=[{start_epoch: -1, image_size: 20}]", "start_epoch is -1; give a number >= 0"),
    ("data.resolution_phases=[{start_epoch: 0, image_size: 2.5}]", "image_size is 2.5; give an integer"),
])
def test_bad_overrides(override, message):
    with pytest.raises(UserError) as err:
        config.load("fashion_mnist", [override])
    assert message in str(err.value)


def _assert_user_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("largebatch: error:")]
    assert len(lines) == 1, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.mark.slow   # a subprocess or a process group: make test, not make test-fast
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


@pytest.mark.slow   # a subprocess or a process group: make test, not make test-fast
def test_missing_and_truncated_dataset(cli, tmp_path):
    _assert_user_error(cli("train", "--set", f"data.root={tmp_path / 'nowhere'}", "--dry-run"),
                       "apt-get install -y dataset-fashion-mnist")
    root = tmp_path / "fm"
    root.mkdir()
    for f in FMNIST.iterdir():
        shutil.copy(f, root / f.name)
    data = gzip.decompress((root / "train-images-idx3-ubyte.gz").read_bytes())
    (root / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(data[: len(data) // 2]))
    _assert_user_error(cli("train", "--set", f"data.root={root}", "--dry-run"), "train-images-idx3-ubyte")


@pytest.mark.slow   # a subprocess or a process group: make test, not make test-fast
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


def test_on_off_strings_survive_yaml():
    """YAML 1.1 reads a bare on/off as a boolean; keys whose values are on/off take either."""
    assert config.load("fashion_mnist", ["train.channels_last=on"]).train.channels_last == "on"
    assert config.from_dict({"train": {"channels_last": False}}).train.channels_last == "off"
    assert config.load("fashion_mnist", ["model.name=resnet50"]).model.name == "resnet50"


def test_each_section_validates_itself():
    """World-size-free range checks live on the section: a builder holding only its section can check it."""
    from largebatch.config import BatchConfig, ModelConfig, OptimConfig, ScheduleConfig, TrainConfig

    for section, match in [(ModelConfig(width=0), "model.width is 0"), (OptimConfig(momentum=1.0), "optim.momentum"),
                           (ScheduleConfig(epochs=1, warmup_epochs=2), "schedule.warmup_epochs"),
                           (BatchConfig(phases=[{"start_epoch": 0}]), r"batch.phases\[0\]"),
                           (TrainConfig(ema=1.5), "train.ema")]:
        with pytest.raises(UserError, match=match):
            section.validate()
    for cls in (ModelConfig, OptimConfig, ScheduleConfig, BatchConfig, TrainConfig):
        cls().validate()   # the defaults pass
