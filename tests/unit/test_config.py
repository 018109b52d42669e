"""Config loading: recipes, --set conversion, and the bad inputs that must exit 2 with one sentence."""
import re

import pytest

from largebatch import config, resume
from largebatch.errors import UserError


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
    ("data.resolution_phases=[{start_epoch: 0, size: 20}]", "data.resolution_phases[0] has unknown keys ['size']"),
    ("data.resolution_phases=[{image_size: 20}]", "must give start_epoch and image_size; it lacks start_epoch"),
    ("data.resolution_phases=[3]", "data.resolution_phases[0] must be a mapping with start_epoch and image_size, got 3"),
    ("data.resolution_phases=[{start_epoch: -1, image_size: 20}]", "start_epoch is -1; give a number >= 0"),
    ("data.resolution_phases=[{start_epoch: 0, image_size: 2.5}]",
     "data.resolution_phases[0].image_size must be a whole number, got 2.5; fix it in the recipe."),
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








def test_on_off_strings_survive_yaml():
    """YAML 1.1 reads a bare on/off as a boolean; keys whose values are on/off take either."""
    assert config.load("fashion_mnist", ["train.channels_last=on"]).train.channels_last == "on"
    assert config.from_dict({"train": {"channels_last": False}}).train.channels_last == "off"
    assert config.load("fashion_mnist", ["model.name=resnet50"]).model.name == "resnet50"


def test_each_section_validates_itself():
    """World-size-free range checks live on the section: a builder holding only its section can check it."""
    from largebatch.config import BatchConfig, BatchPhase, ModelConfig, OptimConfig, ScheduleConfig, TrainConfig

    for section, match in [(ModelConfig(width=0), "model.width is 0"), (OptimConfig(momentum=1.0), "optim.momentum"),
                           (ScheduleConfig(epochs=1, warmup_epochs=2), "schedule.warmup_epochs"),
                           (BatchConfig(phases=[BatchPhase(0, 0)]), r"batch.phases\[0\].global_batch is 0"),
                           (TrainConfig(ema=1.5), "train.ema")]:
        with pytest.raises(UserError, match=match):
            section.validate()
    with pytest.raises(UserError, match=r"batch.phases\[0\] must give start_epoch and global_batch"):
        BatchConfig(phases=[{"start_epoch": 0}])   # entries given as mappings go through the loader
    for cls in (ModelConfig, OptimConfig, ScheduleConfig, BatchConfig, TrainConfig):
        cls().validate()   # the defaults pass


def test_every_bound_is_checked_where_it_is_stated():
    """Each numeric bound is written once, on its field (the reference shows that text), and the loader refuses a
    value just outside it in one sentence naming the key: no bound is shown but unchecked, none checked by hand."""
    from largebatch.config.fields import Bound

    entries = {"batch.phases": {"start_epoch": 0, "global_batch": 64},   # the required keys of each list entry
               "data.resolution_phases": {"start_epoch": 0, "image_size": 8},
               "ensemble.segments": {"epochs": 1, "collapse": True}}
    checked = 0
    for row in config.reference():
        if not row.bounds.startswith((">", "(", "[")):   # choices, or any value of the type
            continue
        bound, whole = Bound.parse(row.bounds), row.type.startswith("whole number")
        step = 1 if whole else 0.5
        outside = [bound.low if bound.low_open else bound.low - step]
        if bound.high != float("inf"):
            outside.append(bound.high if bound.high_open else bound.high + step)
        for value in outside:
            if "[]" in row.key:
                list_key, name = row.key.split("[].")
                section, key = list_key.split(".")
                data, where = {section: {key: [{**entries[list_key], name: value}]}}, f"{list_key}[0].{name}"
            else:
                section, key = row.key.split(".")
                data, where = {section: {key: value}}, row.key
            with pytest.raises(UserError, match=rf"^{re.escape(where)} is "):
                config.from_dict(data)
            checked += 1
    assert checked > 70


def test_global_batch_beside_phases_is_refused(tmp_path):
    """batch.global_batch and batch.phases spell one setting: both in one recipe is one sentence (the global batch
    would be ignored); a --set of one replaces the other, as a later --set of a key replaces an earlier; with
    phases the run's global_batch is the first phase's, and config.yaml leaves it out, so a run's config.yaml is
    a recipe for the same run."""
    phases = "batch.phases=[{start_epoch: 0, global_batch: 512}, {start_epoch: 2, global_batch: 1024}]"
    both = tmp_path / "both.yaml"
    both.write_text("batch:\n  global_batch: 1024\n  phases:\n    - {start_epoch: 0, global_batch: 512}\n")
    with pytest.raises(UserError, match=r"gives both batch.global_batch and batch.phases; .* remove batch.global_batch"):
        config.load(str(both))
    cfg = config.load("fashion_mnist", [phases])   # the recipe's global_batch gives way to the override's phases
    assert config.load("fashion_mnist", ["batch.global_batch=256", phases]).to_dict() == cfg.to_dict()   # last wins
    assert cfg.batch.global_batch == 512 and [p.global_batch for p in cfg.batch.phases] == [512, 1024]
    back = config.load("fashion_mnist_sony_batch_control", ["batch.global_batch=300"])   # and phases to a batch
    assert back.batch.phases == [] and back.batch.global_batch == 300
    config.save(cfg, tmp_path / "config.yaml")
    saved = config.load_yaml(tmp_path / "config.yaml")
    assert "global_batch" not in saved["batch"] and saved["batch"]["phases"][1] == {"start_epoch": 2,
                                                                                   "global_batch": 1024, "lr": None}
    assert config.load(str(tmp_path / "config.yaml")).to_dict() == {**cfg.to_dict(), "recipe": str(tmp_path / "config.yaml")}


def test_saved_configs_of_older_runs_are_read(tmp_path):
    """A run's config.yaml written before the typed phases and per-optimizer eps still evaluates and resumes:
    optim.eps becomes the optimizer's own eps, a global_batch beside phases is dropped (the run ignored it), a
    phase without lr compares equal to the same phase read now; a recipe with optim.eps gets one sentence."""
    old = {"batch": {"global_batch": 2048, "phases": [{"start_epoch": 0, "global_batch": 1024},
                                                      {"start_epoch": 1, "global_batch": 2048}]},
           "optim": {"name": "lamb", "eps": 1e-8, "lr": 0.002}, "schedule": {"epochs": 3, "warmup_epochs": 1}}
    cfg = config.from_dict(old, saved=True)
    assert cfg.optim.lamb_eps == 1e-8 and cfg.batch.global_batch == 1024
    assert resume.resume_changes(old, cfg) == []
    lars = config.from_dict({"optim": {"name": "lars", "eps": 1e-9}}, saved=True)
    assert lars.optim.lars_eps == 1e-9 and lars.optim.lamb_eps == 1e-6
    with pytest.raises(UserError, match=r"optim.eps is now optim.lars_eps \(LARS\) or optim.lamb_eps \(LAMB\)"):
        config.from_dict({"optim": {"eps": 1e-8}})
    changed = config.from_dict({**old, "optim": {"name": "lamb", "lr": 0.002},
                                "batch": {"phases": [{"start_epoch": 0, "global_batch": 1024, "lr": 0.5},
                                                     {"start_epoch": 1, "global_batch": 2048}]}})
    assert [key for key, _, _ in resume.resume_changes(old, changed)] == ["batch.phases", "optim.lamb_eps"]


def test_config_reference_page_is_generated():
    """docs/config.md is `largebatch config --markdown`: every key with type, default, bounds and doc, from the
    dataclasses. After changing a key, regenerate it with `largebatch config --markdown > docs/config.md`."""
    from pathlib import Path

    from largebatch.commands import config as config_command

    page = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    assert page == config_command.markdown(), "docs/config.md is stale: run `largebatch config --markdown > docs/config.md`"
    rows = config.reference()
    flat = {f"{s}.{k}" for s, sec in config.Config().to_dict().items() if isinstance(sec, dict) for k in sec}
    assert {r.key for r in rows if "[]" not in r.key} == flat   # every key, and nothing else
    assert all(r.doc for r in rows), [r.key for r in rows if not r.doc]
    by_key = {r.key: r for r in rows}
    assert by_key["optim.momentum"].bounds == "[0, 1)" and by_key["train.precision"].bounds == "fp32, bf16, fp16"
    assert by_key["batch.phases[].global_batch"].default == "required" and by_key["batch.phases[].lr"].default == "null"
    assert by_key["comm.pipeline"].doc.startswith("torus2d/hierarchical: pieces of a tensor")


def test_config_command(capsys):
    """largebatch config: keys by prefix with a recipe's resolved values; a prefix that names nothing, or --set
    without --recipe, is one sentence and exit 2."""
    from largebatch.cli import main

    assert main(["config", "batch.phases", "--recipe", "fashion_mnist_sony_batch_control"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("batch.phases ") and '= [{"start_epoch": 0, "global_batch": 1024' in out
    assert "batch.phases[].lr" in out and not any(line.startswith("optim") for line in out.splitlines())
    assert main(["config", "optm"]) == 2
    assert "no config key starts with 'optm' (did you mean 'optim'?)" in capsys.readouterr().err
    assert main(["config", "--set", "optim.lr=1"]) == 2
    assert "give --recipe NAME with it" in capsys.readouterr().err


def _read_names(exclude: set[str]) -> set[str]:
    """Attribute names read (`x.name`, load context) and string constants in largebatch's modules outside
    `exclude` (paths below largebatch/: a file, or a package's folder)."""
    import ast
    from pathlib import Path

    root = Path(config.__file__).parent.parent
    names: set[str] = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(str(rel) == e or rel.parts[0] == e for e in exclude):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    return names


def test_every_config_key_is_read_somewhere():
    """A key that is accepted must be read: each field name is read as an attribute (or named, for the comm
    options that the hook reads through largebatch.comm.options.OPTIONS) outside the config package, which only
    declares and checks them. The rule sees a key nobody reads (a made-up name is not found)."""
    read = _read_names({"config"})
    unread = [r.key for r in config.reference() if r.key.split(".")[-1].split("[]")[-1] not in read]
    assert not unread, f"config keys accepted but read by nobody: {unread}"
    assert "never_read_by_anyone" not in read
