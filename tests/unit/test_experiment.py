"""Experiments as data (largebatch/commands/experiment.py): an experiment file expands to its studies' commands,
with schedules as fractions of the run; every mistake in the file is one sentence naming it, exit 2."""
from pathlib import Path

import pytest

from largebatch import cli
from largebatch.commands import experiment
from largebatch.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    return path


def test_fractions_of_the_run_follow_each_studys_budget(tmp_path):
    """"A/B run" is A/B of that study's epochs, rounded to 3 decimals; lists item by item; paths are the file's
    own, "{out}" is OUT; settings keep the file's order (common's first)."""
    path = _write(tmp_path, """
common: {study: batch-scaling, set: {model.width: 8}, opt_set: {sgd: {schedule.milestones: [30/90 run, 80/90 run]}}}
studies:
  - {name: short, epochs: 8, val_split: 100, set: {schedule.warmup_epochs: 5/90 run}, batches: [64, 128]}
  - {name: long, epochs: 24, from_tuning: ["{out}/short", ../elsewhere], claims_only: true}
""")
    (short, kind, argv), (long_name, _, argv2) = experiment.plan(path, tmp_path / "out")
    assert (short, kind, long_name) == ("short", "batch-scaling", "long")
    assert argv == ["--set", "model.width=8", "--set", "schedule.warmup_epochs=0.444",
                    "--opt-set", "sgd:schedule.milestones=[2.667,7.111]", "--epochs", "8", "--val-split", "100",
                    "--batches", "64,128", "--out", str(tmp_path / "out" / "short")]
    assert "sgd:schedule.milestones=[8,21.333]" in argv2 and "--claims-only" in argv2
    tunings = [v for f, v in zip(argv2, argv2[1:]) if f == "--from-tuning"]
    assert tunings == [str(tmp_path / "out" / "short"), str(tmp_path / ".." / "elsewhere")]
    relative = experiment.plan(path, Path("runs") / "exp")[1][2]   # the default --out is relative: so is "{out}"
    assert [v for f, v in zip(relative, relative[1:]) if f == "--from-tuning"][0] == str(Path("runs") / "exp" / "short")


@pytest.mark.parametrize("text, words", [
    ("studies: []", "has no list of studies"),
    ("studies: [{name: a, study: batch-scaling}]\nextra: 1", "unknown keys ['extra']"),
    ("studies: [{name: a, study: scaling}]", "studies[0] (a).study is 'scaling'; give one of batch-scaling"),
    ("studies: [{name: a, study: batch-scaling, batchez: [64]}]", "has no setting 'batchez'; valid: batches, claims_only, epochs"),
    ("studies: [{name: a, study: batch-scaling, set: {schedule.warmup_epochs: 1/12 run}}]",
     "is '1/12 run', a fraction of the run, but the study gives no epochs"),
    ("studies: [{name: a, study: batch-scaling}, {name: a, study: ensemble}]", "studies[1].name 'a' must be unique"),
    ("studies: [{name: ../x, study: ensemble}]", "must be unique and a plain directory name"),
    ("studies: [{name: a, study: batch-scaling, claims_only: 1}]", "is a switch; give true or false"),
    ("studies: [{name: a, study: ensemble, from_tuning: [x, y]}]", "takes one tuning directory, got 2"),
    ("studies: [{name: a, study: batch-scaling, out: x}]", "has no setting 'out'"),
])
def test_a_bad_experiment_file_is_one_sentence(tmp_path, capsys, text, words):
    path = _write(tmp_path, text)
    assert cli.main(["study", str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and words in err, err
    assert not (tmp_path / "out").exists()


def test_names_only_and_missing_files(tmp_path, capsys):
    assert experiment.resolve("claims") == ROOT / "experiments" / "claims.yaml"
    assert cli.main(["study", "no_such_experiment"]) == 2
    assert "no experiment file no_such_experiment; give a YAML file, one of experiments/ (batch_control" in \
        capsys.readouterr().err
    with pytest.raises(UserError, match="--only tunes: experiment file .* has no study of that name; its studies: "
                                        "tune, final, restarts"):
        experiment.plan(ROOT / "experiments" / "collapsed_ensemble.yaml", tmp_path, only=["tunes"])
    names = [n for n, _, _ in experiment.plan(ROOT / "experiments" / "collapsed_ensemble.yaml", tmp_path)]
    assert names == ["tune", "final"]   # the optional follow-up only when named
    assert [n for n, _, _ in experiment.plan(ROOT / "experiments" / "collapsed_ensemble.yaml", tmp_path,
                                             only=["restarts"])] == ["restarts"]


def test_a_study_taken_from_another_file_is_stated_once(tmp_path):
    """`from: {file, study, out}` takes another file's study whole (its common's settings too), its "{out}" the
    given out (where that experiment ran), its relative paths that file's; a setting given here replaces its own;
    this file's common does not apply to it. So experiments/claims.yaml restates nothing of the three files."""
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "base.yaml").write_text("""
common: {study: batch-scaling, set: {model.width: 8}, micro_batch: 128}
studies:
  - {name: tune, epochs: 8, val_split: 100, lr_grid: {sgd: [0.5]}}
  - {name: final, epochs: 24, batches: [64, 128], from_tuning: ["{out}/tune", ../elsewhere],
     set: {schedule.warmup_epochs: 1/12 run}}
""")
    path = _write(tmp_path, """
common: {seeds: 9}
studies:
  - {name: again, from: {file: other/base.yaml, study: final, out: ran}, batches: [64], claims_only: true}
  - {name: here, from: {file: other/base.yaml, study: final}}
""")
    (name, kind, argv), (_, _, here) = experiment.plan(path, tmp_path / "out")
    assert (name, kind) == ("again", "batch-scaling")
    assert argv == ["--set", "model.width=8", "--set", "schedule.warmup_epochs=2", "--micro-batch", "128",
                    "--epochs", "24", "--batches", "64", "--from-tuning", str(tmp_path / "ran" / "tune"),
                    "--from-tuning", str(tmp_path / "other" / ".." / "elsewhere"), "--claims-only",
                    "--out", str(tmp_path / "out" / "again")]   # its common's set and its own, as its file merges them
    tunings = [v for f, v in zip(here, here[1:]) if f == "--from-tuning"]
    assert tunings[0] == str(tmp_path / "out" / "tune") and "--seeds" not in here   # without out: this OUT's


@pytest.mark.parametrize("study, words", [
    ("{name: a, from: other.yaml}", "studies[0].from must be {file: OTHER.yaml, study: NAME}"),
    ("{name: a, from: {file: other.yaml, study: b, where: x}}", "studies[0].from must be"),
    ("{name: a, from: {file: missing.yaml, study: b}}", "no experiment file"),
    ("{name: a, from: {file: other.yaml, study: c}}", "has no study 'c'; its studies: b, d"),
    ("{name: a, from: {file: other.yaml, study: d}}", "study 'd' of"),
])
def test_a_bad_from_is_one_sentence(tmp_path, capsys, study, words):
    (tmp_path / "other.yaml").write_text("studies: [{name: b, study: ensemble}, "
                                         "{name: d, from: {file: exp.yaml, study: a}}]\n")
    path = _write(tmp_path, f"studies: [{study}]")
    assert cli.main(["study", str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and words in err, err
