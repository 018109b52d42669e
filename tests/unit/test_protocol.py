"""The study protocol as data (largebatch/commands/study/protocol.yaml, protocol.py): the package's protocol gives
the committed cells their settings, typed as they ran; a study's --protocol (an experiment file's `protocol:`)
replaces its keys for that study and is recorded with it; every mistake in one is a sentence naming the key."""
import json
from pathlib import Path

import pytest

from largebatch import cli
from largebatch.commands import experiment
from largebatch.commands.study import directory, kinds, plan, protocol, verdict

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--set", "data.dataset=synthetic", "--set", "data.synthetic_size=640", "--set", "data.image_size=8",
        "--set", "model.width=4", "--nproc-per-node", "1", "--epochs", "1"]


def _listed(err: str) -> list[str]:
    return [line.strip() for line in err.splitlines() if line.startswith("  largebatch train ")]


def test_the_package_protocol_gives_the_committed_cells_their_settings_as_they_ran():
    """Every setting of every optimizer is in each committed final cell of that optimizer, as its cell command
    wrote it (2.0 stays 2.0, null stays null): the YAML keeps the values typed."""
    cells = json.loads((ROOT / "results/large_batch/final/study.json").read_text())["cells"]
    optimizers = protocol.default("batch-scaling").optimizers
    assert set(optimizers) == {c["optimizer"] for c in cells}
    args = kinds.parser("batch-scaling").parse_args([])
    for cell in cells:
        mine = [s for s in plan.cell_overrides(args, cell["batch"], cell["optimizer"], 0)
                if s.split("=")[0] in optimizers[cell["optimizer"]]]
        assert mine and all(f"--set {s}" in cell["command"] for s in mine), (mine, cell["command"])
    assert "optim.lr=2.0" in plan.cell_overrides(args, 64, "lars", 0)
    assert "schedule.warmup_start_lr=null" in plan.cell_overrides(args, 64, "sgd", 0)


def test_an_experiments_protocol_replaces_the_packages_for_its_study(tmp_path, capsys):
    """`protocol:` in an experiment file reaches its study as --protocol: a new optimizer name beside the
    package's (its "A/B run" values as epochs), claims of its own with their rule; the cells, --claims-only and
    the verdicts follow it, and the study records it among the settings a resumed study must repeat."""
    path = tmp_path / "exp.yaml"
    path.write_text("""
common: {study: batch-scaling, epochs: 6, micro_batch: 64}
studies:
  - name: wide
    batches: [64, 128, 256]
    optimizers: [sgd, lars_tc2]
    claims_only: true
    protocol:
      optimizers:
        lars_tc2: {optim.name: lars, optim.scaling_rule: linear, optim.trust_coefficient: 0.002,
                   schedule.warmup_epochs: 1/6 run}
      claims:
        - {claim: LARS at 128 within 2 points, cell: {batch: 128, optimizer: lars_tc2}, rule: {op: ">=", points: -2}}
""")
    ((_, kind, argv),) = experiment.plan(path, tmp_path / "out")
    given = json.loads(argv[argv.index("--protocol") + 1])
    assert given["optimizers"]["lars_tc2"]["schedule.warmup_epochs"] == 1.0   # 1/6 of the study's 6 epochs

    study = argv[:argv.index("--out")] + TINY + ["--out", str(tmp_path / "out" / "wide"), "--dry-run"]
    assert cli.main(["study", kind, *study]) == 0
    listed = _listed(capsys.readouterr().err)
    assert len(listed) == 2   # the claim's cell and SGD at the smallest batch; 256 is read by no claim
    assert all("optim.trust_coefficient=0.002" in c and "schedule.warmup_epochs=1.0" in c and "global_batch=128" in c
               for c in listed if "optim.name=lars" in c)
    assert sum("optim.name=sgd" in c and "global_batch=64" in c for c in listed) == 1

    args = kinds.parser(kind).parse_args(study)
    mine = kinds.of_args(kind, args)
    assert [c.claim for c in mine.protocol.claims] == ["LARS at 128 within 2 points"]
    rows = {"a": {"batch": 64, "optimizer": "sgd", "top1_mean": 0.90, "top1_std": 0.0, "seeds": 1},
            "b": {"batch": 128, "optimizer": "lars_tc2", "top1_mean": 0.885, "top1_std": 0.0, "seeds": 1}}
    (judged,) = verdict.judge(mine, rows)
    assert judged["held"] and judged["claim"] == "LARS at 128 within 2 points"   # -1.5 points: inside 2
    assert not verdict.judge(kinds.KINDS[kind], rows)   # the package's claims read none of these rows


def test_a_study_records_its_protocol_and_a_resume_must_repeat_it(tmp_path, capsys):
    """study_settings.json holds the protocol a study was given (the file's content, not its path); a study
    started with the package's protocol records none, as studies always have, and refuses a --protocol later."""
    out = tmp_path / "out"
    flags = ["batch-control", "--batch", "64", "--start-batch", "32", "--switch-epochs", "1", *TINY[:-2],
             "--epochs", "2", "--out", str(out)]
    args = kinds.parser("batch-control").parse_args(flags[1:])
    stored = {k: getattr(args, k) for k in kinds.KINDS["batch-control"].settings if k != "protocol"}
    out.mkdir()
    (out / directory.SETTINGS).write_text(json.dumps(stored))
    assert cli.main(["study", *flags, "--dry-run"]) == 0   # the same settings: it resumes
    capsys.readouterr()
    own = tmp_path / "mine.yaml"
    own.write_text("claims: [{claim: control at least fixed, cell: {variant: control}, against: {variant: fixed}, "
                   "rule: {op: '>=', points: 0}}]\n")
    assert cli.main(["study", *flags, "--protocol", str(own), "--dry-run"]) == 2
    assert "holds a study with other settings" in capsys.readouterr().err
    inline = "{claims: [{claim: control at least fixed, cell: {variant: control}, against: {variant: fixed}, " \
             "rule: {op: '>=', points: 0}}]}"
    (out / directory.SETTINGS).write_text(json.dumps({**stored, "protocol": protocol.given(str(own))}))
    for again, code in ((["--protocol", str(own)], 0), (["--protocol", inline], 0), ([], 2)):
        assert cli.main(["study", *flags, *again, "--dry-run"]) == code   # the content counts, not the path
        assert ("holds a study with other settings" in capsys.readouterr().err) == bool(code)


# an ensemble claim with one `also` rule, as --protocol takes it
ALSO = ("{{claims: [{{claim: x, cell: {{variant: {cell}}}, against: {{variant: {against}}}, rule: {{op: '>', "
        "points: 0}}, also: [{{name: {name}, label: g, figure: {figure}, rule: {{op: '>', points: 0}}}}]}}]}}")


@pytest.mark.parametrize("kind, given, words", [
    ("batch-scaling", "{optimisers: {}}", "has ['optimisers']; study batch-scaling takes optimizers, baseline, claims"),
    ("batch-scaling", "{claims: [{claim: x, cell: {batch: 64, optimizer: sgd}, rule: {op: '=>', points: 1}}]}",
     "--protocol.claims[0].rule.op is '=>'; give one of >=, >, <"),
    ("batch-scaling", "{claims: [{claim: x, cell: {batch: 64, optimizer: adam}, rule: {op: '>', points: 1}}]}",
     "--protocol.claims[0].cell names \"adam\", not one of the protocol's: sgd, lars, lamb"),
    ("batch-scaling", "{claims: [{claim: x, cell: {batch: 64, optimizer: [sgd]}, rule: {op: '>', points: 1}}]}",
     "--protocol.claims[0].cell names [\"sgd\"], not one of the protocol's"),
    ("batch-scaling", "{baseline: {optimizer: [sgd]}}", "--protocol.baseline is {\"optimizer\": [\"sgd\"]}; give"),
    ("batch-scaling", "{optimizers: {mine: {optim.lr: 2}}}", "--protocol.optimizers.mine has no optim.name"),
    ("batch-scaling", "{optimizers: {lars: {optim.note: 2024-01-01}}}",
     "--protocol.optimizers.lars.optim.note is \"2024-01-01\"; give a number, text"),
    ("batch-scaling", "{optimizers: {lars: {schedule.warmup_epochs: 5/90 run}}}",
     "is '5/90 run', a fraction of the run: an experiment file's protocol takes it"),
    ("batch-scaling", "{claims: [{claim: x, cell: {batch: 64, optimizer: sgd}, rule: {op: '>', points: 1}, "
                      "also: [{name: g, label: g, figure: noise_scale, rule: {op: '>', points: 0}}]}]}",
     "also[0].figure is \"noise_scale\"; give one of the figures of the claim's row (none: "),
    ("ensemble", ALSO.format(cell="single", against="ensemble", name="g", figure="best_snapshot"),
     "also[0].figure is \"best_snapshot\"; give one of the figures of the claim's row (none: "),
    ("ensemble", ALSO.format(cell="ensemble", against="single", name="holds", figure="swa"),
     "has name \"holds\"; give a name of letters, digits and _ (not one of difference, spread, holds)"),
    ("batch-control", "{variants: {verdict: [\"batch.global_batch={batch}\"]}}",
     "--protocol.variants has the name 'verdict'; give letters, digits, _ . - only"),
    ("batch-scaling", "{claims: [{claim: x, cell: {batch: 64}, rule: {op: '>', points: 1}}]}",
     "--protocol.claims[0].cell is {\"batch\": 64}; give {batch: ..., optimizer: ...}"),
    ("batch-scaling", "{baseline: {optimizer: adam}}", "--protocol.baseline is {\"optimizer\": \"adam\"}; give"),
    ("batch-scaling", "{optimizers: {lars: {lr: 2}}}", "--protocol.optimizers.lars is {\"optim.name\": \"lars\", "),
    ("batch-scaling", "{optimizers: {a/b: {optim.name: sgd}}}", "has the name 'a/b'; give letters, digits"),
    ("ensemble", ALSO.format(cell="ensemble", against="single", name="g", figure="swa2"),
     "also[0].figure is \"swa2\"; give one of the figures of the claim's row (best_snapshot, swa)"),
    ("batch-control", "{claims: [{claim: x, cell: {variant: control}, rule: {op: '>', points: 0}}]}",
     "has no against; give the variant it is measured against"),
    ("batch-control", "{variants: {fixed: [\"schedule.epochs={epoch}\"]}}",
     "the protocol's variant 'fixed' has the --set item 'schedule.epochs={epoch}', which study batch-control "
     "cannot fill"),
    ("batch-control", "{variants: [", "--protocol '{variants: [' is not valid YAML"),
    ("batch-control", "{}", "--protocol '{}' gives no keys; give a mapping of the keys it replaces"),
    ("batch-control", "no/such/file.yaml", "--protocol no/such/file.yaml: no such file"),
])
def test_a_bad_protocol_is_one_sentence(tmp_path, capsys, kind, given, words):
    """On the command line and in an experiment file (with the file and key named), before anything trains."""
    out = tmp_path / "out"
    own = {"batch-control": ["--batch", "64", "--start-batch", "32", "--switch-epochs", "1", "--epochs", "2"],
           "ensemble": ["--batch", "64", "--cycles", "1", "--cycle-epochs", "1", "--epochs", "3"]}.get(kind, [])
    assert cli.main(["study", kind, *TINY, *own, "--out", str(out), "--protocol", given, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and words in err and err.count("\n") == 1, err
    if given.startswith("{") and "[" != given[-1] and "{epoch}" not in given and "run}" not in given and given != "{}":
        path = tmp_path / "exp.yaml"
        path.write_text(f"studies: [{{name: a, study: {kind}, protocol: {given}}}]\n")
        assert cli.main(["study", str(path), "--dry-run", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        where = f"{path}: studies[0] (a).protocol"
        assert "Traceback" not in err and words.replace("--protocol", where) in err, err
    assert not out.exists()


def test_an_optimizer_given_in_part_keeps_the_rest_and_a_claim_may_name_its_own_row(tmp_path):
    """optimizers merge setting by setting (lars with another lr is still lars); a batch-scaling claim with an
    `against` of its own has --claims-only run that row too, even at the smallest batch; text beyond the BMP
    survives the experiment file's JSON."""
    args = kinds.parser("batch-scaling").parse_args(["--protocol", "{optimizers: {lars: {optim.lr: 3.0}}}"])
    sets = plan.cell_overrides(args, 256, "lars", 0)
    assert {"optim.name=lars", "optim.lr=3.0", "optim.trust_coefficient=0.001"} <= set(sets)

    own = protocol.of("batch-scaling", {"claims": [
        {"claim": "LARS at 256 above SGD at 256", "cell": {"batch": 256, "optimizer": "lars"},
         "against": {"batch": 256, "optimizer": "sgd"}, "rule": {"op": ">", "points": 0}},
        {"claim": "LARS at 64 above SGD at 64", "cell": {"batch": 64, "optimizer": "lars"},
         "against": {"batch": 64, "optimizer": "sgd"}, "rule": {"op": ">", "points": 0}}]})
    assert plan.claim_cells([64, 256, 1024], ["sgd", "lars"], own.claims, own.baseline) == {
        (64, "sgd"), (64, "lars"), (256, "sgd"), (256, "lars")}

    path = tmp_path / "exp.yaml"
    path.write_text("studies: [{name: a, study: batch-control, protocol: {claims: [{claim: \"control 🚀\", "
                    "cell: {variant: control}, against: {variant: fixed}, rule: {op: '>', points: 0}}]}}]\n",
                    encoding="utf-8")
    ((_, _, argv),) = experiment.plan(path, tmp_path / "out")
    text = argv[argv.index("--protocol") + 1]
    assert protocol.given(text)["claims"][0]["claim"] == "control 🚀" == protocol.of(
        "batch-control", protocol.given(text)).claims[0].claim


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "sub", "is a directory; give a YAML file"),
    (lambda d: d / "list.yaml", "gives a list; give a mapping of the keys it replaces"),
    (lambda d: d / "empty.yaml", "gives no keys; give a mapping of the keys it replaces"),
    (lambda d: d / "bad.yaml", "is not valid YAML"),
])
def test_a_protocol_file_that_is_no_mapping_is_one_sentence(tmp_path, capsys, make, words):
    (tmp_path / "sub").mkdir()
    (tmp_path / "list.yaml").write_text("- claims\n")
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    (tmp_path / "bad.yaml").write_text("claims: [\n")
    assert cli.main(["study", "batch-control", *TINY, "--epochs", "2", "--switch-epochs", "1", "--out",
                     str(tmp_path / "out"), "--protocol", str(make(tmp_path)), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and words in err and err.count("\n") == 1, err


@pytest.mark.parametrize("value", ["null", "{}", "[claims]"])
def test_an_experiment_files_protocol_that_is_no_mapping_is_one_sentence(tmp_path, capsys, value):
    path = tmp_path / "exp.yaml"
    path.write_text(f"studies: [{{name: a, study: ensemble, protocol: {value}}}]\n")
    assert cli.main(["study", str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{path}: studies[0] (a).protocol is " in err and \
        "give a mapping of the protocol keys it replaces (variants, claims)" in err, err
