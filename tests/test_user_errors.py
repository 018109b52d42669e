"""Bad input as a new user gives it: one sentence naming the problem and the fix, exit code 2, no
traceback, and nothing already written lost or left corrupt. Most cases run the command line in this
process (`largebatch.cli.main`); the ones that need workers or a full disk run for real."""
import gzip
import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from largebatch import checkpoint, cli as cli_mod
from largebatch.data import shards

from conftest import FMNIST

pytestmark = pytest.mark.timeout(300)

TINY = ["--set", "model.width=4", "--set", "data.dataset=synthetic", "--set", "data.synthetic_size=256",
        "--set", "data.image_size=8", "--set", "batch.global_batch=64", "--set", "schedule.epochs=1",
        "--set", "schedule.warmup_epochs=0", "--set", "train.plots=false", "--quiet"]


@pytest.fixture
def main(capsys):
    """Run `largebatch ARGS` in this process; (exit code, the one error line)."""
    def run(*args):
        code = cli_mod.main([str(a) for a in args])
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        lines = [line for line in err.splitlines() if line.startswith("largebatch: error:")]
        return code, (lines[0] if len(lines) == 1 else err)
    return run


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
])
def test_out_of_range_numbers(main, override, fragment):
    _expect(main("train", "--set", override, "--dry-run"), fragment)


def test_yaml_1_1_exponent_floats_are_numbers(main, capsys):
    code, _ = main("train", "--set", "optim.lr=1e-3", "--set", "optim.weight_decay=5e-5", "--dry-run")
    assert code == 0


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
    _expect(main("cluster"), "cluster run")
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


def test_one_constraint_at_a_time(main):
    _expect(main("bench", "scaling", "--steps", "0"), "--steps is 0; give 1 or more.")
    _expect(main("bench", "speedrun", "--lr", "0"), "--lr is 0.0; give a positive learning rate.")
    _expect(main("study", "batch-scaling", "--seeds", "0"), "--seeds is 0; give 1 or more.")


def test_plan_numbers(main):
    _expect(main("plan", "--price-per-device-hour", "-1"), "--price-per-device-hour is -1.0")
    _expect(main("plan", "--devices", "0"), "--devices is 0")
    _expect(main("plan", "--epochs", "0"), "--epochs is 0.0")
    _expect(main("plan", "--devices-per-node", "6", "--sweep", "devices=8:4096"), "no device count")


# ------------------------------------------------------------------ paths the user gave
def test_os_errors_on_user_paths_are_one_sentence(main, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _expect(main("plan", "--sweep", "devices=8:16", "--out", a_file / "plots"), "cannot use", str(a_file))
    _expect(main("bench", "allreduce", "--nproc", "2", "--json", a_file / "x.json", "--sizes", "1KB",
                 "--algorithms", "native", "--rounds", "1", "--small-bytes", "0"), "--json", "cannot create")


def test_data_roots(main, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _expect(main("train", "--set", f"data.root={a_file}", "--dry-run"), "is a file, not a directory")
    _expect(main("train", "--set", "data.dataset=imagefolder", "--set", f"data.root={a_file}", "--dry-run"),
            "is a file, not a directory")
    empty = tmp_path / "fm"
    empty.mkdir()
    for f in FMNIST.iterdir():
        shutil.copy(f, empty / f.name)
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
    _expect(main("train", *args, "--dry-run"), "train/b has no JPEG files")
    for i in range(4):   # every training and test image corrupt
        (root / "train" / "b" / f"{i}.jpg").write_bytes(b"not a jpeg")
        (root / "train" / "a" / f"{i}.jpg").write_bytes(b"not a jpeg")
    (root / "val" / "a" / "0.jpg").write_bytes(b"not a jpeg")
    _expect(main("train", *args, "--run-dir", tmp_path / "run"), "every image of a training batch was corrupt")


def test_checkpoints_that_do_not_fit(cli, main, tmp_path):
    run = tmp_path / "run"
    cli("train", *TINY, "--run-dir", run, check=True)
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()}
    # resume with another model, another optimizer: the sentence names what differs, nothing is touched
    _expect(main("train", *TINY, "--set", "model.width=8", "--run-dir", run, "--resume"),
            "does not fit this model", "size mismatch", "recipe and --set options the run was started with")
    _expect(main("train", *TINY, "--set", "optim.name=lamb", "--run-dir", run, "--resume"),
            "was written with optim.name=sgd but this run uses lamb")
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()} == before
    # evaluate --checkpoint: a foreign file, a directory, another run's model
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"junk")
    _expect(main("evaluate", run, "--checkpoint", junk), "is not a largebatch checkpoint")
    _expect(main("evaluate", run, "--checkpoint", tmp_path), "is a directory")
    other = tmp_path / "other"
    cli("train", *TINY, "--set", "model.width=8", "--run-dir", other, check=True)
    path, _ = checkpoint.latest(other / "checkpoints")
    _expect(main("evaluate", run, "--checkpoint", path), "does not fit this run's model")


def test_full_disk_leaves_nothing_half_written(tmp_path):
    """A real full file system (a 256 KiB tmpfs): the atomic writer removes its temporary file, and a
    failed `data pack` leaves neither the destination nor a temporary sibling."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    try:
        with pytest.raises(OSError):
            checkpoint.atomic_write(mnt / "big.bin", b"x" * (1 << 20))
        assert list(mnt.iterdir()) == []
        src = tmp_path / "if"
        for split in ("train", "val"):
            for c in ("a", "b"):
                (src / split / c).mkdir(parents=True)
                for i in range(12):   # about 1 MB of JPEGs in all: more than the file system holds
                    noise = np.random.default_rng(i).integers(0, 255, (96, 96, 3), dtype=np.uint8)
                    Image.fromarray(noise).save(src / split / c / f"{i}.jpg", quality=100)
        from largebatch.errors import UserError

        with pytest.raises(UserError, match="could not write"):
            shards.pack(src, mnt / "shards", shard_bytes=1 << 20)
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


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


def test_a_user_error_on_one_rank_exits_2_with_its_sentence_once(cli, tmp_path):
    """Rank 1 alone raises a user error (LARGEBATCH_FAULTS=error@1:1): the launcher exits 2 (not 1, not
    -6), the rank's sentence is printed, the peer's collective failure is one line, no traceback, and the
    agent's log lines do not bury the sentence."""
    proc = cli("train", *TINY, "--nproc-per-node", "2", "--run-dir", tmp_path / "run",
               env={"LARGEBATCH_FAULTS": "error@1:1"})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr
    assert proc.stderr.count("injected error at step 1 on rank 1") == 1, proc.stderr
    assert "ChildFailedError" not in proc.stderr and "Sending process" not in proc.stderr
    # a config error met by both ranks is printed once, not once per rank
    same = cli("train", *TINY, "--nproc-per-node", "2", "--run-dir", tmp_path / "run2",
               "--set", "batch.global_batch=100000")
    assert same.returncode == 2 and same.stderr.count("largebatch: error:") == 1, same.stderr


def test_plan_refuses_a_global_batch_larger_than_the_dataset(main):
    _expect(main("plan", "--devices", "8", "--global-batch", "4096", "--dataset-size", "1000"),
            "larger than the dataset (1000 images)")
