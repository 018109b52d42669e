"""Bad input as a new user gives it: one sentence naming the problem and the fix, exit code 2, no
traceback, and nothing already written lost or left corrupt. Most cases run the command line in this
process (`largebatch.cli.main`); the ones that need workers or a full disk run for real."""
import gzip
import json
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import fmnist_copy
from PIL import Image

from largebatch import cli as cli_mod

pytestmark = pytest.mark.timeout(300)

TINY = ["--set", "model.width=4", "--set", "data.dataset=synthetic", "--set", "data.synthetic_size=256",
        "--set", "data.image_size=8", "--set", "batch.global_batch=64", "--set", "schedule.epochs=1",
        "--set", "schedule.warmup_epochs=0", "--set", "train.plots=false", "--quiet"]


def _expect(result, *fragments):
    code, line = result
    assert code == 2, line
    for f in fragments:
        assert f in line, line


# ------------------------------------------------------------------ recipes and --set: every number checked
@pytest.mark.parametrize("override, fragment", [
    ("train.max_steps=0", "train.max_steps is 0"),
    ("train.checkpoint_every=-1", "train.checkpoint_every is -1"),
    ("train.eval_every=-2", "train.eval_every is -2"),
    ("model.width=0", "model.width is 0"),
    ("optim.lr=.nan", "optim.lr is nan; give a finite number"),
    ("optim.lr=.inf", "optim.lr is inf"),
    ("data.loader_workers=-1", "data.loader_workers is -1"),
    ("data.num_classes=1", "data.num_classes is 1"),
    ("data.min_scale=1.5", "data.min_scale is 1.5"),
    ("train.threads=0", "train.threads is 0"),
    ("comm.pipeline=0", "comm.pipeline is 0"),
    ("schedule.power=-1", "schedule.power is -1.0"),
    ("ensemble.cycles=-1", "ensemble.cycles is -1"),
    ("train.max_nonfinite=-1", "train.max_nonfinite is -1"),
    ("data.image_size=100000", "do not fit in memory at data.image_size=100000"),   # were allocator tracebacks
    ("data.crop_padding=100000", "data.crop_padding=100000; give smaller values"),
    ("schedule.gamma=5", "schedule.gamma is 5.0; step decay multiplies the lr by gamma"),   # would raise the lr
    ("schedule.end_lr=2.5", "schedule.end_lr is 2.5, above the peak lr of 2 (optim.lr 1 scaled to the global batch"),
    ("optim.lr=1e300", "optim.lr is 1e+300; give a learning rate per optim.reference_batch images of at most 10,000"),
    ("batch.phases=[{start_epoch: 0, global_batch: 256, lr: 1e300}]", "batch.phases[0].lr is 1e+300; give a positive"),
    ("schedule.warmup_start_lr=2.5", "schedule.warmup_start_lr is 2.5, above the peak lr of 2 (optim.lr 1 scaled"),
    ("comm.timeout_s=1e-7", "comm.timeout_s is 1e-07; give 1 to 604800 seconds"),
    ("comm.timeout_s=1e20", "comm.timeout_s is 1e+20"),   # was an OverflowError in timedelta at the first collective
    ("optim.weight_decay=1e300", "optim.weight_decay is 1e+300; give a value in [0, 1)"),
    ("optim.weight_decay=1", "optim.weight_decay is 1.0"),
    ("data.num_classes=100000000000", "data.num_classes is 100000000000; give at most 1,000,000 classes"),
    ("ensemble.cycles=1001", "ensemble.cycles is 1001; give at most 1000 cycles"),
    ("schedule.epochs=1e300", "schedule.epochs is 1e+300; give at most 1,000,000 epochs"),   # was accepted
    ("ensemble.cycle_epochs=1e300", "ensemble.cycle_epochs is 1e+300; give at most 1,000,000"),   # "use longer cycles"
    ("model.width=1e300", "model.width is 1e+300; give a number below 2**63"),   # not the 301-digit integer
])
def test_out_of_range_numbers(main, override, fragment):
    _expect(main("train", "--set", override, "--dry-run"), fragment)


def test_bounds_admit_their_edges(main):
    """gamma 1 (no decay), end_lr at the peak lr (flat), a 1 s timeout and 8 threads per core are allowed."""
    code, err = main("train", "--set", "schedule.decay=step", "--set", "schedule.gamma=1", "--set", "schedule.end_lr=1",
                     "--set", "comm.timeout_s=1", "--set", "train.threads=1", "--dry-run")
    assert code == 0, err
    code, err = main("train", "--set", "schedule.decay=poly", "--set", "schedule.end_lr=1", "--dry-run")
    assert code == 0, err
    # with batch phases the smallest peak lr bounds end_lr (the sony recipe's phases: 0.4 and up)
    _expect(main("train", "fashion_mnist_sony_batch_control", "--set", "schedule.end_lr=0.5", "--dry-run"),
            "schedule.end_lr is 0.5, above the peak lr of 0.4 (the smallest of batch.phases)")


def test_threads_are_bounded_by_the_host(main, monkeypatch):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    _expect(main("train", "--set", "train.threads=100000", "--dry-run"),
            "train.threads is 100000; this host has 16 cores, so give at most 128 threads per worker (8 per core")
    assert main("train", "--set", "train.threads=128", "--dry-run")[0] == 0
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    _expect(main("train", "--set", "train.threads=65", "--dry-run"), "this host has 2 cores, so give at most 64")


def test_ensemble_cycles_are_checked_before_the_plan(main, monkeypatch):
    """ensemble.cycles=100000000 built a segment per cycle for minutes (and gigabytes) in --dry-run."""
    from largebatch.schedule import Plan

    def no_segments(self):
        raise AssertionError("the plan's segments were built")

    monkeypatch.setattr(Plan, "_segments", no_segments)
    _expect(main("train", "--set", "ensemble.cycles=100000000", "--dry-run"),
            "ensemble.cycles is 100000000; give at most 1000 cycles (0 = off).")


def test_yaml_1_1_exponent_floats_are_numbers(main, capsys, tmp_path):
    code, _ = main("train", "--set", "optim.lr=1e-3", "--set", "optim.weight_decay=5e-5", "--dry-run")
    assert code == 0
    # inside lists and mappings too (YAML 1.1 made strings of them there: "batch.phases[0].lr is '1e-3'")
    from largebatch import config

    cfg = config.load("fashion_mnist", ["batch.phases=[{start_epoch: 0, global_batch: 256, lr: 1e-3}]",
                                        "schedule.decay=step", "schedule.milestones=[1e0, 2e0]"])
    assert cfg.batch.phases[0].lr == 0.001 and cfg.schedule.milestones == [1.0, 2.0]
    cfg = config.load("fashion_mnist", ["batch.phases=[{start_epoch: 0e0, global_batch: 1e3}]",   # whole numbers
                                        "data.resolution_phases=[{start_epoch: 0, image_size: 2.8e1}]"])
    assert cfg.batch.phases[0].global_batch == 1000 and isinstance(cfg.batch.phases[0].global_batch, int)
    assert cfg.data.resolution_phases[0].image_size == 28
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  lr: 2e-1\n  betas: [9e-1, 9.99e-1]\nschedule:\n  epochs: 3\n  decay: cosine\n")
    cfg = config.load(str(recipe))
    assert cfg.optim.lr == 0.2 and cfg.optim.betas == [0.9, 0.999]
    assert yaml.safe_load("lr: 1e-3") == {"lr": "1e-3"}      # PyYAML's own loader is left as it is


def test_world_size_and_launcher_arguments(main):
    _expect(main("train", "--dry-run", "--world-size", "0"), "--world-size is 0")
    _expect(main("train", *TINY, "--nproc-per-node", "2", "--max-restarts", "-1"), "--max-restarts is -1")
    _expect(main("train", *TINY, "--nproc-per-node", "0"), "--nproc-per-node is 0")




def test_unreadable_recipes(main, tmp_path):
    binary = tmp_path / "r.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    _expect(main("train", binary, "--dry-run"), "is not a UTF-8 text file")
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    _expect(main("train", listing, "--dry-run"), "must be a YAML mapping")
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    _expect(main("train", folder, "--dry-run"), "is a directory; give a YAML file")


def test_commands_and_groups(main):
    _expect(main("bench"), "'bench' needs a subcommand", "bench train")
    _expect(main("bench", "nope"), "'bench' needs a subcommand")
    for old in (["cluster"], ["cluster", "run", "--nodes", "2", "--", "train"]):   # renamed: one sentence, the new name
        _expect(main(*old), "'cluster run' is now 'largebatch emulate hosts' (emulate a cluster on this machine")
    _expect(main("frobnicate"), "unknown command")


def test_help_texts(capsys):
    for args in (["bench", "optim", "--help"], ["bench", "speedrun", "--help"], ["plan", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            cli_mod.main(args)
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert "python -m" not in out.split("\n")[0]                 # the prog is the command a user types
        assert "usage: largebatch " in out
    with pytest.raises(SystemExit):
        cli_mod.main(["plan", "--help"])
    out = capsys.readouterr().out
    for flag in ("--devices", "--global-batch", "--epochs", "--precision", "--price-per-device-hour"):
        block = out.split(flag, 2)[-1].split("\n  --")[0]
        assert len(block.split()) > 2, f"{flag} has no help text"
    with pytest.raises(SystemExit):
        cli_mod.main(["bench", "speedrun", "--help"])
    assert "compared with." in " ".join(capsys.readouterr().out.split())   # the whole sentence
    with pytest.raises(SystemExit):
        cli_mod.main(["bench", "allreduce", "--help"])
    block = capsys.readouterr().out.split("  --compression", 1)[1].split("\n  --")[0]
    assert len(block.split()) > 2, "--compression has no help text"
    with pytest.raises(SystemExit):
        cli_mod.main(["emulate", "hosts", "--help"])
    assert "-- COMMAND" in capsys.readouterr().out.split("\n\n")[0]   # the usage shows the command after --


def test_one_constraint_at_a_time(main):
    _expect(main("bench", "scaling", "--steps", "0"), "--steps is 0; give 1 or more.")
    _expect(main("bench", "speedrun", "--lr", "0"), "--lr is 0.0; give a positive learning rate.")
    _expect(main("study", "batch-scaling", "--seeds", "0"), "--seeds is 0; give 1 or more.")


def test_plan_numbers(main):
    _expect(main("plan", "--price-per-device-hour", "-1"), "--price-per-device-hour is -1.0")
    _expect(main("plan", "--devices", "0"), "--devices is 0")
    _expect(main("plan", "--epochs", "0"), "--epochs is 0.0")
    _expect(main("plan", "--devices-per-node", "6", "--sweep", "devices=8:4096"), "no device count")
    _expect(main("plan", "--torus-x", "3", "--devices", "8"),   # was silently ignored
            "--torus-x 3 is the torus2d row length, but --algorithm is native; add --algorithm torus2d")
    _expect(main("plan", "--torus-x", "2", "--sweep", "devices=8:16"), "--torus-x 2 does not apply to --sweep")


# ------------------------------------------------------------------ paths the user gave
def test_os_errors_on_user_paths_are_one_sentence(main, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _expect(main("plan", "--sweep", "devices=8:16", "--out", a_file / "plots"), "cannot use", str(a_file))
    _expect(main("bench", "allreduce", "--nproc", "2", "--json", a_file / "x.json", "--sizes", "1KB",
                 "--algorithms", "native", "--rounds", "1", "--small-bytes", "0"), "--json", "is a file, not a directory")


def test_data_roots(main, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _expect(main("train", "--set", f"data.root={a_file}", "--dry-run"), "is a file, not a directory")
    _expect(main("train", "--set", "data.dataset=imagefolder", "--set", f"data.root={a_file}", "--dry-run"),
            "is a file, not a directory")
    empty = fmnist_copy(tmp_path / "fm")
    raw = gzip.decompress((empty / "train-images-idx3-ubyte.gz").read_bytes())
    header = bytearray(raw[:16])
    header[4:8] = (0).to_bytes(4, "big")   # an IDX file of 0 images
    (empty / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(bytes(header)))
    _expect(main("train", "--set", f"data.root={empty}", "--dry-run"), "hold 0 images")


def _jpeg(path: Path, seed: int):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(path)


def test_imagefolder_classes_and_all_corrupt_images(main, tmp_path):
    root = tmp_path / "if"
    _jpeg(root / "train" / "a" / "0.jpg", 0)
    _jpeg(root / "val" / "a" / "0.jpg", 1)
    args = ["--set", "data.dataset=imagefolder", "--set", f"data.root={root}", "--set", "data.image_size=8",
            "--set", "data.loader_workers=0", "--set", "batch.global_batch=2", "--set", "model.width=4",
            "--set", "train.plots=false", "--quiet"]
    _expect(main("train", *args, "--dry-run"), "has 1 class folder(s)")
    (root / "train" / "b").mkdir()
    _expect(main("train", *args, "--dry-run"), "train/b has no images")
    for i in range(4):   # every training and test image corrupt
        (root / "train" / "b" / f"{i}.jpg").write_bytes(b"not a jpeg")
        (root / "train" / "a" / f"{i}.jpg").write_bytes(b"not a jpeg")
    (root / "val" / "a" / "0.jpg").write_bytes(b"not a jpeg")
    _expect(main("train", *args, "--run-dir", tmp_path / "run"), "every image of a training batch was corrupt")






def test_data_pack_never_overwrites(main, tmp_path):
    src = tmp_path / "if"
    for split in ("train", "val"):
        for c in ("a", "b"):
            _jpeg(src / split / c / "0.jpg", hash((split, c)) % 100)
    dst = tmp_path / "shards"
    assert main("data", "pack", src, dst)[0] == 0
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    _expect(main("data", "pack", src, dst), "is not empty", "never overwritten")
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # no temporary sibling left
    index = json.loads((dst / "index.json").read_text())
    assert index["splits"]["train"]["total"] == 2


def test_chaos_checks_its_inputs_before_any_work(main, tmp_path):
    t = time.monotonic()
    _expect(main("chaos", "--out", tmp_path / "c", "--baseline-dir", tmp_path / "missing", "--kills", "1"),
            "--baseline-dir", "is not a directory")
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    _expect(main("chaos", "--out", tmp_path / "c", "--baseline-dir", unfinished, "--kills", "1"),
            "no summary.json and no run is writing it")
    (tmp_path / "c" / "chaos").mkdir(parents=True)
    (tmp_path / "c" / "chaos" / "metrics.jsonl").write_text("{}\n")
    _expect(main("chaos", "--out", tmp_path / "c", "--kills", "1"), "already holds a chaos run")
    assert time.monotonic() - t < 30




def test_plan_refuses_a_global_batch_larger_than_the_dataset(main):
    _expect(main("plan", "--devices", "8", "--global-batch", "4096", "--dataset-size", "1000"),
            "larger than the dataset (1000 images)")


# ------------------------------------------------------------------ list items, names and integers a section reads
@pytest.mark.parametrize("override, fragment", [
    ("optim.betas=[a, b]", "optim.betas is ['a', 'b']; give two numbers"),
    ("schedule.milestones=[a]", "schedule.milestones has 'a'; give a list of epochs"),
    ("schedule.milestones=[.nan]", "schedule.milestones has nan"),
    ("schedule.milestones=[-5]", "schedule.milestones has -5"),
    ("data.resolution_phases=[{start_epoch: .nan, image_size: 8}]", "data.resolution_phases[0].start_epoch is nan; give a finite number"),
    ("batch.phases=[{start_epoch: 0, global_batch: 64}, {start_epoch: a, global_batch: 32}]",
     "batch.phases[1].start_epoch must be a whole number, got 'a'; fix it in the recipe"),
    ("batch.phases=[{start_epoch: 0, global_batch: 64, lr: .nan}]", "batch.phases[0].lr is nan; give a finite number"),
    ("batch.phases=[{start_epoch: 0, global_batch: 64, lr: true}]", "batch.phases[0].lr must be a number, got True"),
    ("batch.phases=[{start_epoch: 0, global_batch: 64}, {start_epoch: 0, global_batch: 32}]",
     "batch.phases[1].start_epoch is 0, the same as batch.phases[0]'s; phases need strictly increasing start epochs"),
    ("data.resolution_phases=[{start_epoch: 1, image_size: 16}, {start_epoch: 1, image_size: 20}]",
     "data.resolution_phases[1].start_epoch is 1, the same as data.resolution_phases[0]'s"),   # one silently won
    ("train.seed=99999999999999999999", "train.seed is 99999999999999999999; give a number below 2**63"),
    ("model.width=99999999999999999999", "model.width is 99999999999999999999"),
    ("model.name=resnet", "model.name is 'resnet' (did you mean"),
    ("comm.inter=ring", "comm.inter is set but comm.algorithm native does not use it"),
    ("comm.impl=p2p", "comm.impl is set but comm.algorithm native"),
])
def test_list_items_names_and_comm_options_are_checked_when_the_recipe_loads(main, override, fragment):
    """Each used to pass --dry-run, then give a traceback mid-run (milestones, betas, a phase's start, a huge
    seed or width), train silently with a nan lr, or (comm options) be ignored by one process."""
    _expect(main("train", "--set", override, "--dry-run"), fragment)


def test_comm_values_are_checked_without_workers(main):
    # the layout a run checks when its hook starts, --dry-run checks for the world size it plans
    _expect(main("train", "--set", "comm.algorithm=torus2d", "--set", "comm.grid=2x2", "--world-size", "8", "--dry-run"),
            "comm.grid is 2x2 (4 positions) but --world-size is 8; give a grid XxY with X*Y = 8, e.g. comm.grid=4x2.")
    _expect(main("train", "--set", "comm.algorithm=hierarchical", "--set", "comm.local_size=3", "--world-size", "8",
                 "--dry-run"), "comm.local_size is 3, which does not divide --world-size 8")
    assert main("train", "--set", "comm.algorithm=torus2d", "--set", "comm.grid=2x4", "--world-size", "8",
                "--dry-run")[0] == 0
    _expect(main("train", "--set", "comm.algorithm=torus2d", "--set", "comm.grid=abc", "--dry-run"),
            "torus2d grid 'abc' is not of the form XxY")
    _expect(main("train", "--set", "comm.algorithm=hierarchical", "--set", "comm.inter=bogus", "--dry-run"),
            "inter='bogus' is unknown")
    _expect(main("train", "--set", "comm.algorithm=torus2d", "--set", "comm.grid=0x4", "--dry-run"),
            "torus2d grid '0x4' is not of the form XxY")   # was read as the hex number 4: "must be a str, got 4"
    code, _ = main("train", "--set", "schedule.milestones=[8, 16, 21.333]", "--set", "comm.algorithm=hierarchical",
                   "--set", "comm.impl=native", "--set", "comm.inter=native", "--dry-run")
    assert code == 0


def test_a_model_that_cannot_take_the_images_or_fit_in_memory(main, tmp_path):
    _expect(main("train", *TINY, "--set", "data.image_size=2", "--run-dir", tmp_path / "a"),
            "model speedrun cannot take 2x2-pixel images", "give a larger data.image_size")
    _expect(main("train", *TINY, "--set", "data.resolution_phases=[{start_epoch: 0, image_size: 4}]",
                 "--run-dir", tmp_path / "b"), "cannot take 4x4-pixel images", "image_size in data.resolution_phases")
    _expect(main("train", *TINY, "--set", "model.width=1000000", "--run-dir", tmp_path / "c"),
            "model speedrun at width 1000000 does not fit in memory", "give a smaller model.width")


def _files(run: Path) -> dict:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
            and p.name != ".largebatch.lock"}




def _tuning(tmp_path: Path, name: str, text: str) -> Path:
    (tmp_path / name).mkdir()
    (tmp_path / name / "study.json").write_text(text)
    return tmp_path / name


STUDY = {   # tiny --dry-run arguments of each study command
    "batch-scaling": ["--batches", "64", "--optimizers", "sgd", "--epochs", "1"],
    "batch-control": ["--epochs", "2", "--batch", "64", "--start-batch", "32", "--switch-epochs", "1"],
    "ensemble": ["--epochs", "2", "--batch", "64", "--cycles", "1", "--cycle-epochs", "0.5",
                 "--collapse-epochs", "0.25"],
}
SYNTHETIC = ["--seeds", "1", "--nproc-per-node", "1", "--set", "data.dataset=synthetic", "--set",
             "data.synthetic_size=256", "--set", "data.image_size=8", "--set", "model.width=4", "--dry-run"]


def _study(main, command, *args):
    return main("study", command, *STUDY[command], *SYNTHETIC, *args)


def test_from_tuning_odd_study_directories(main, tmp_path):
    out = tmp_path / "out"
    corrupt = _tuning(tmp_path, "corrupt", '{"val_split": 64, "table": {')   # cut short mid-write
    listing = _tuning(tmp_path, "list", "[1, 2]")
    no_table = _tuning(tmp_path, "no_table", '{"kind": "batch-control", "val_split": 64}')
    scaling = _tuning(tmp_path, "scaling", json.dumps({"val_split": 64, "table": {"sgd@64": {
        "batch": 64, "optimizer": "sgd", "lr": 0.1, "top1_mean": 0.5}}}))   # batch-scaling writes no "kind"
    control = _tuning(tmp_path, "control", json.dumps({"kind": "batch-control", "val_split": 64,
                                                       "table": {"fixed": {"lr": 0.1}}}))
    for bad in (corrupt, listing, no_table):
        for command in ("batch-control", "batch-scaling"):
            _expect(_study(main, command, "--from-tuning", bad, "--out", out), "is not the study.json of a study")
    _expect(_study(main, "batch-control", "--from-tuning", scaling, "--out", out),
            "is from study batch-scaling, not study batch-control")
    _expect(_study(main, "batch-scaling", "--from-tuning", control, "--out", out),
            "is from study batch-control, not study batch-scaling")
    _expect(_study(main, "ensemble", "--from-tuning", control, "--out", out), "not study ensemble")
    assert not out.exists()
    # a study directory whose settings file was cut short
    out.mkdir()
    (out / "study_settings.json").write_text("{")
    for command in ("batch-control", "batch-scaling"):
        _expect(_study(main, command, "--out", out), "study_settings.json is not a readable settings file")
    assert [p.name for p in out.iterdir()] == ["study_settings.json"]


@pytest.mark.parametrize("command, args, fragment", [
    ("ensemble", ["--cycles", "0"], "--cycles is 0; give 1 or more"),
    ("ensemble", ["--cycles", "-1"], "--cycles is -1"),
    ("ensemble", ["--cycles", "1", "--cycle-epochs", "nan"], "--cycle-epochs is nan"),
    ("ensemble", ["--cycles", "1", "--collapse-epochs", "inf"], "--collapse-epochs is inf"),
    ("ensemble", ["--epochs", "inf"], "--epochs is inf"),
    ("batch-scaling", ["--epochs", "1e300"], "--epochs is 1e+300; give a positive number of epochs (at most"),
    ("ensemble", ["--cycles", "1000000000"], "leaves 0 of the"),   # not "leaves -4e+09"
    ("ensemble", ["--batch", "0"], "--batch is 0; give a positive global batch"),
    ("batch-control", ["--start-batch", "0"], "--start-batch is 0"),
    ("batch-control", ["--switch-epochs", "0.5"], "--switch-epochs is 0.5; give a whole number of epochs"),
    ("batch-control", ["--lr-grid", ""], "--lr-grid is empty"),
    ("batch-scaling", ["--batches", "64,0"], "--batches is 0; give positive global batches"),
    ("batch-scaling", ["--epochs", "inf"], "--epochs is inf"),
])
def test_study_flags_name_themselves(main, tmp_path, command, args, fragment):
    """Each used to be reported as a config key the user never set (ensemble.cycles, schedule.epochs,
    batch.phases[1].start_epoch, batch.global_batch), run silently (--lr-grid ""), or (--cycles 0) train and
    then fail in the table."""
    _expect(_study(main, command, *args, "--out", tmp_path / "out"), fragment)
    assert not (tmp_path / "out").exists()


def test_paths_and_pack_numbers(main, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _expect(main("plan", "--sweep", "devices=8:16", "--out", a_file), "a file is where a directory is needed")
    _expect(main("evaluate", a_file), f"run directory {a_file} is a file, not a directory")
    src = tmp_path / "if"
    for split in ("train", "val"):
        for c in ("a", "b"):
            _jpeg(src / split / c / "0.jpg", 0)
    for args, fragment in ((["--shard-size-mb", "nan"], "--shard-size-mb is nan"),
                           (["--shard-size-mb", "inf"], "--shard-size-mb is inf"),
                           (["--shard-size-mb", "1e-300"], "of at least one byte"),   # was 0 bytes: a shard per image
                           (["--seed", str(10**20)], "--seed is 100000000000000000000; give a 64-bit integer")):
        _expect(main("data", "pack", src, tmp_path / "shards", *args), fragment)
        assert not (tmp_path / "shards").exists()
    _expect(main("data", "pack", src, a_file / "shards"), "could not write", "a file is where a directory is needed")
    assert a_file.read_text() == "x"


# ------------------------------------------------------------------ bench, chaos, cluster, plan: before any work
@pytest.mark.parametrize("args, fragment", [
    (["bench", "data", "--width", "0"], "--width is 0; give 1 or more pixels"),
    (["bench", "data", "--height", "-5"], "--height is -5"),
    (["bench", "data", "--min-scale", "nan"], "--min-scale is nan; give an area fraction in (0, 1]"),
    (["bench", "data", "--min-scale", "2"], "--min-scale is 2.0"),
    (["bench", "allreduce", "--training", "--steps", "0"], "--steps is 0; give 1 or more"),
    (["bench", "allreduce", "--training", "--bucket-mb", "nan"], "--bucket-mb is nan"),
    (["bench", "allreduce", "--rounds", "0"], "--rounds is 0"),
    (["bench", "allreduce", "--warmup", "-1"], "--warmup is -1"),
    (["bench", "allreduce", "--sizes", "1KB:1MB:x"], "FACTOR 'x' is not an integer"),
    (["bench", "optim", "--device", "tpu"], "--device is 'tpu'; give cpu or cuda"),
    (["bench", "optim", "--threads", "0"], "--threads is 0"),
    (["bench", "scaling", "--timeout", "nan"], "--timeout is nan; give a positive number of seconds"),
    (["bench", "speedrun", "--lr", "inf", "--budget", "1", "--epochs", "1"], "--lr is inf"),
    (["bench", "speedrun", "--threads", "0"], "--threads is 0"),
])
def test_bench_numbers(main, args, fragment):
    """Each used to give a traceback (a zero-size JPEG, sleep(nan), torch.device('tpu'), a division by zero
    --steps on every worker), or to run the whole benchmark on a meaningless value (--rounds 0, --lr inf)."""
    _expect(main(*args), fragment)


@pytest.mark.parametrize("args, fragments", [
    (["--image-size", "0"], ["--image-size is 0; give 1 or more pixels."]),
    (["--model", "foo"], ["--model is 'foo'; choose one of: resnet18"]),
    (["--model", "speedrun", "--image-size", "4"], ["cannot take 4x4-pixel images", "give a larger --image-size."]),
    # were refused by the scaled run's launcher as --nproc-per-node / train.threads, after the one-worker run
    (["--workers", "65"], ["--workers is 65; this host has 2 cores, so give at most 64 local workers"]),
    (["--threads", "65"], ["--threads is 65; this host has 2 cores, so give at most 64 threads"]),
])
def test_bench_scaling_checks_its_flags_before_any_run(main, monkeypatch, args, fragments):
    """Each was found by the first worker run and reported as the config key (data.image_size, model.name)."""
    from largebatch.commands.bench import scaling

    def no_run(*_):
        raise AssertionError("a training run started")

    monkeypatch.setattr(scaling, "run_training", no_run)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    _expect(main("bench", "scaling", *args), *fragments)


def test_chaos_delay_and_tolerance(main, tmp_path):
    """--max-delay -1 failed in time.sleep after the whole baseline run; nan compared false everywhere."""
    for flag, value in (("--max-delay", "-1"), ("--max-delay", "nan"), ("--tolerance", "nan")):
        _expect(main("chaos", flag, value, "--out", tmp_path / "c", "--baseline-dir", tmp_path / "missing"),
                f"{flag} is {float(value)}; give a finite number >= 0")
    assert not (tmp_path / "c").exists()


def test_output_files_are_checked_before_measuring(main, tmp_path):
    """A --json path that is a directory, or under a file, was found only when writing, after the benchmark."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    tiny_train = ["--model", "speedrun", "--width", "4", "--image-size", "8", "--batch", "2", "--steps", "1",
                  "--rounds", "1", "--peak-size", "16", "--configs", "fp32"]
    for command in (["bench", "train", *tiny_train], ["bench", "data", "--images", "64", "--no-memory"],
                    ["bench", "scaling"], ["bench", "speedrun", "--budget", "1", "--epochs", "1"]):
        _expect(main(*command, "--json", tmp_path), "--json", "is a directory; give a file path")
        _expect(main(*command, "--json", a_file / "x.json"), "--json", f"{a_file} is a file, not a directory")
    _expect(main("plan", "--calibrate", "--catalog-out", tmp_path), "--catalog-out", "is a directory")
    assert a_file.read_text() == "x"


def test_a_measured_catalog_cut_short_or_reshaped(main, tmp_path, monkeypatch):
    """`plan` read the user's catalog (what --calibrate wrote, or $LARGEBATCH_CATALOG) with no check: a file
    cut short or edited into another shape was a traceback in every plan command."""
    for name, text, fragment in (("cut.yaml", "devices: [1, 2\n", "is not valid YAML"),
                                 ("list.yaml", "- 1\n- 2\n", "is a list, not a mapping of sections"),
                                 ("entry.yaml", "devices:\n  a100: 5\n", "section 'devices' that is not a mapping")):
        (tmp_path / name).write_text(text)
        monkeypatch.setenv("LARGEBATCH_CATALOG", str(tmp_path / name))
        _expect(main("plan"), f"the measured catalog {tmp_path / name}", fragment, "fix or delete it")
        assert (tmp_path / name).read_text() == text


def test_local_worker_counts_are_bounded(main, tmp_path, monkeypatch):
    """`evaluate RUN --nproc-per-node 100000` started workers until the host ran out of processes (and a
    SIGTERM then left hundreds of them orphaned); nothing may reach the launcher here."""
    import os

    from largebatch import launch

    def no_launch(_):
        raise AssertionError("workers were started")

    monkeypatch.setattr(launch, "run_agent", no_launch)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    fragment = "is 65; this host has 2 cores, so give at most 64 local workers"
    _expect(main("train", *TINY, "--nproc-per-node", "65", "--run-dir", tmp_path / "run"), "--nproc-per-node", fragment)
    _expect(main("evaluate", tmp_path, "--nproc-per-node", "65"), "--nproc-per-node", fragment)
    _expect(main("bench", "allreduce", "--nproc", "65"), "--nproc", fragment)
    assert not (tmp_path / "run").exists()


def test_data_pack_never_writes_into_its_source(main, tmp_path):
    """`data pack SRC SRC/train/shards` succeeded and left the shards as a class folder of SRC, which then
    failed every training on SRC (and every later pack of it)."""
    src = tmp_path / "if"
    for split in ("train", "val"):
        for c in ("a", "b"):
            _jpeg(src / split / c / "0.jpg", 0)
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    _expect(main("data", "pack", src, src / "train" / "shards"), "is inside the source's train/ split")
    _expect(main("data", "pack", src, src / "val" / "a" / "x"), "is inside the source's val/ split")
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before


def test_bench_data_never_writes_into_an_existing_dataset(main, tmp_path):
    """`bench data --dir` ("reused if present") added ten class folders of generated JPEGs to whatever
    directory it was given, a real ImageFolder included."""
    src = tmp_path / "if"
    _jpeg(src / "train" / "cat" / "0.jpg", 0)
    small = ["--images", "64", "--passes", "1", "--stage-images", "0", "--no-memory", "--width", "16",
             "--height", "16", "--size", "8", "--workers", "0"]
    _expect(main("bench", "data", *small, "--dir", src), f"--dir {src} holds train, which bench data did not write")
    assert [p.name for p in (src / "train").iterdir()] == ["cat"]


def test_emulate_hosts_checks_its_command_before_building_hosts(main):
    """An unknown largebatch command built the namespaced hosts and then failed on every node; a missing
    --exec program gave torchrun's traceback from every node."""
    _expect(main("emulate", "hosts", "--nodes", "2", "--", "frobnicate"),
            "'frobnicate' after '--' is not a largebatch command", "--exec")
    _expect(main("emulate", "hosts", "--", "bench", "nope"), "'bench nope'", "bench allreduce")
    _expect(main("emulate", "hosts", "--exec", "--", "/nonexistent/prog"),
            "--exec program '/nonexistent/prog' is not an executable file or on PATH")


def test_thread_counts_are_bounded(main, monkeypatch):
    """torch.set_num_threads(100000) crashed bench train (a segfault, no message); like train.threads, at most 8
    threads per core (64 at least)."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    for command in (["bench", "train"], ["bench", "optim"], ["bench", "speedrun"]):
        _expect(main(*command, "--threads", "100000"),
                "--threads is 100000; this host has 2 cores, so give at most 64 threads (8 per core, 64 at least).")


@pytest.mark.parametrize("args, fragment", [
    (["bench", "train", "--classes", "1"], "--classes is 1; give 2 or more"),   # was data.num_classes, after 4 s
    (["bench", "optim", "--model", "foo"], "--model is 'foo'; choose one of: resnet18"),   # was "(model.name)"
    (["bench", "speedrun", "--seed", str(10**20)], "--seed is 100000000000000000000; give a 64-bit integer"),
    (["plan", "--model", "foo"], "--model is 'foo'; choose one of: resnet18"),
    (["plan", "--width", "100000000"], "model resnet50 at width 100000000"),   # a RuntimeError from torch
    (["plan", "--num-classes", str(10**14)], "buckets; give a larger --bucket-mb or a smaller model"),   # MemoryError
    (["plan", "--bucket-mb", "1e-9"], "--bucket-mb 1e-09 splits the 49 MiB gradient of resnet50 into 51,114,064"),
])
def test_bench_and_plan_flags_that_gave_tracebacks_or_config_keys(main, args, fragment):
    _expect(main(*args), fragment)


@pytest.mark.parametrize("args, fragment", [
    (["--pipeline", "0"], "--pipeline is 0; give 1 or more pieces"),
    (["--small-bytes", "-1"], "--small-bytes is -1; give 0 or more bytes"),
    (["--local-size", "0"], "--local-size is 0"),
    (["--local-size", "3"], "--local-size 3 does not divide --nproc 4 into equal nodes; give a divisor of 4."),
    (["--grid", "0x4"], "--grid '0x4' is not of the form XxY"),
    (["--grid", "3x3"], "--grid 3x3 has 9 positions but --nproc is 4; give a grid XxY with X*Y = 4."),
    (["--training", "--width", "0"], "--width is 0; give 1 or more channels"),
])
def test_bench_allreduce_checks_its_flags_before_the_workers(main, monkeypatch, args, fragment):
    """Each started 4 workers, and each worker refused it by its config key (pipeline=, comm.local_size,
    comm.grid, width) after the launch."""
    from largebatch import launch

    def no_launch(_):
        raise AssertionError("workers were started")

    monkeypatch.setattr(launch, "run_agent", no_launch)
    _expect(main("bench", "allreduce", "--nproc", "4", *args), fragment)


def test_dry_run_names_the_worker_flag_given(main):
    _expect(main("train", "--dry-run", "--nproc-per-node", "-1"), "--nproc-per-node is -1; give 1 or more")   # --world-size
    _expect(main("train", "--dry-run", "--nproc-per-node", "0"), "--nproc-per-node is 0")   # planned for 1 worker


def test_yaml_1_1_exponent_integers_are_numbers(main):
    """YAML 1.1 reads 1e4 as a string: an integer key takes the whole number it is, not 'must be a whole number'."""
    from largebatch import config

    cfg = config.load("fashion_mnist", ["data.synthetic_size=1e4", "train.log_every=1.0e+2"])
    assert cfg.data.synthetic_size == 10000 and cfg.train.log_every == 100
    assert isinstance(cfg.data.synthetic_size, int)
    _expect(main("train", "--set", "data.synthetic_size=1e-3", "--dry-run"), "data.synthetic_size must be a whole number, got 0.001")


def test_data_paths_are_named_as_given(main, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _expect(main("train", "--set", "data.dataset=shards", "--set", f"data.root={a_file}", "--dry-run"),
            f"data.root {a_file} is a file, not a directory")   # was "cannot read index.json ...; re-run data pack"
    _expect(main("data", "pack", a_file, tmp_path / "out"), f"data pack source {a_file} is a file")   # was data.root
    _expect(main("data", "pack", tmp_path / "missing", tmp_path / "out"), "data pack source", "does not exist")
    _expect(main("bench", "speedrun", "--root", a_file), f"--root {a_file} is a file, not a directory")
    assert not (tmp_path / "out").exists()


def test_help_texts_name_no_module_paths(capsys):
    """Help showed largebatch.models.MODELS, largebatch.comm.SMALL_BYTES and `python -m largebatch.commands...`;
    study batch-control and study ensemble showed both commands' descriptions as one paragraph."""
    import re

    for command in cli_mod.COMMANDS:
        with pytest.raises(SystemExit):
            cli_mod.main([*command.split(), "--help"])
        out = capsys.readouterr().out
        assert not re.search(r"largebatch\.[a-z]", out) and "python -m" not in out, (command, out)
        if command in ("study batch-control", "study ensemble"):
            other = "ensemble (Codreanu" if command == "study batch-control" else "batch-control (Sony"
            assert other not in " ".join(out.split()), out


# ------------------------------------------------------------------ a recipe that expands without bound
BILLION_LAUGHS = """\
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h, *h]
model: {name: *i}
"""




def test_safeyaml_counts_shared_nodes_once_per_use():
    from largebatch import safeyaml

    assert safeyaml.load("a: &x [1, 2]\nb: [*x, *x]\n") == {"a": [1, 2], "b": [[1, 2], [1, 2]]}
    with pytest.raises(safeyaml.TooLarge):
        safeyaml.load("a: &x [1, 2, 3]\nb: [*x, *x, *x]\n", limit=19)
    # the mapping, its keys a and b, a's list of 3, b's list of three of them: 1 + 1 + 4 + 1 + 13 = 20 values
    assert safeyaml.load("a: &x [1, 2, 3]\nb: [*x, *x, *x]\n", limit=20) is not None


# ------------------------------------------------------------------ environment values
@pytest.mark.timeout(120)
@pytest.mark.parametrize("env, sentence", [
    ({"WORLD_SIZE": "two"}, "the environment variable WORLD_SIZE is 'two'; it must be a whole number, 1 or more"),
    ({"WORLD_SIZE": "0"}, "the environment variable WORLD_SIZE is '0'; it must be a whole number, 1 or more"),
    ({"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"},
     "the environment variable RANK is '5'; it must be a whole number, 0 to 1; it must be below WORLD_SIZE (2)"),
    ({"WORLD_SIZE": "2", "RANK": "x1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"},
     "the environment variable RANK is 'x1'"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "no host here!", "MASTER_PORT": "29511"},
     "the environment variable MASTER_ADDR is 'no host here!', which is no host name or address"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"},
     "the environment variable MASTER_PORT is '99999'; it must be a whole number, 1 to 65535"),
    ({"TORCHELASTIC_RESTART_COUNT": "-"}, "the environment variable TORCHELASTIC_RESTART_COUNT is '-'"),
    ({"LARGEBATCH_FAULTS": "nan@0:1", "LARGEBATCH_FAULT_HANG_S": "soon"},
     "the environment variable LARGEBATCH_FAULT_HANG_S is 'soon'; it must be a number, 0 or more"),
])
def test_junk_in_the_environment_is_one_sentence_naming_the_variable(tmp_path, main, monkeypatch, env, sentence):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _expect(main("train", "fashion_mnist", "--run-dir", tmp_path / "run", "--set", "data.dataset=synthetic",
                 "--set", "train.max_steps=1", "--set", "model.width=4"), sentence)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("env, store", [
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}, ("127.0.0.1", 29511)),
    ({"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}, None),
    ({"WORLD_SIZE": "2", "RANK": "x1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}, None),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "no host here!", "MASTER_PORT": "29511"}, None),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"}, None),
    ({"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}, None),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "29511"}, None),
])
def test_a_sentence_about_the_rendezvous_variables_asks_no_store(monkeypatch, env, store):
    """A user error is printed once per run through the launcher's store, reached by the rendezvous variables;
    where they are not as torchrun sets them (the sentence is about them) no store is asked, so the sentence
    does not wait for a store's timeout."""
    from largebatch import errors

    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert errors._store_address() == store




