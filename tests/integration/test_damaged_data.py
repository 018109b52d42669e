"""Damaged data with real files and real processes (issue 30): a damaged shard set is refused before training
with one sentence, `data pack` says what it left out and cleans up after a killed pack, and a corrupt image
whose name is not UTF-8 is listed as its bytes while the run finishes (and resumes)."""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LARGEBATCH_FAULTS", "RANK", "WORLD_SIZE")}
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _tree(root: Path, train: int = 12, val: int = 4) -> None:
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("val", val)):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(root / split / c / f"{i}.jpg")


TRAIN = ["--set", "data.image_size=16", "--set", "data.loader_workers=0", "--set", "model.width=8",
         "--set", "batch.global_batch=8", "--set", "schedule.epochs=1", "--set", "schedule.warmup_epochs=0", "--quiet"]


def _one_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("largebatch: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_a_val_shard_cut_in_half_stops_the_run_before_training(cli, tmp_path):
    """Was: exit 0, evaluation on the images of the intact half, nothing said."""
    _tree(tmp_path / "if")
    assert cli("data", "pack", tmp_path / "if", tmp_path / "sh").returncode == 0
    val = tmp_path / "sh" / "val-000000.tar"   # all 8 val images
    val.write_bytes(val.read_bytes()[: val.stat().st_size // 2])
    proc = cli("train", "--run-dir", tmp_path / "run", "--set", "data.dataset=shards",
               "--set", f"data.root={tmp_path / 'sh'}", *TRAIN, env=_env())
    line = _one_error(proc)
    assert f"shard {val}" in line and "re-pack" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_data_pack_says_what_it_skipped(cli, tmp_path):
    _tree(tmp_path / "if")
    (tmp_path / "if" / "train" / "a" / "notes.txt").write_text("x")
    (tmp_path / "if" / "train" / "README").write_text("x")
    (tmp_path / "if" / "val" / "b" / "scan.pdf").write_bytes(b"x")   # a PNG would be packed: torchvision reads it
    proc = cli("data", "pack", tmp_path / "if", tmp_path / "sh")
    assert proc.returncode == 0, proc.stderr
    assert (f"train: skipped 2 entries that are not images (*.jpg, *.jpeg, *.png, ...) in a class folder: "
            f"{tmp_path / 'if' / 'train' / 'README'}, {tmp_path / 'if' / 'train' / 'a' / 'notes.txt'}") in proc.stdout
    assert "val: skipped 1 entries" in proc.stdout and "scan.pdf" in proc.stdout


def test_a_killed_pack_is_cleaned_up_by_the_next_pack_and_a_live_one_is_not(cli, tmp_path):
    """A pack SIGKILLed after writing every shard into its temporary directory (a real process and a real
    signal, landing where the rename would come) left `.sh.packing-PID` behind for good."""
    _tree(tmp_path / "if")
    kill_after_writing = (
        "import os, signal, sys; from pathlib import Path; from largebatch.data import pack as writer; "
        "write = writer._write_shards\n"
        "def killed(*a):\n    write(*a); os.kill(os.getpid(), signal.SIGKILL)\n"
        "writer._write_shards = killed; writer.pack(Path(sys.argv[1]), Path(sys.argv[2]), 1 << 20)")
    proc = subprocess.run([sys.executable, "-c", kill_after_writing, tmp_path / "if", tmp_path / "sh"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    left = list(tmp_path.glob(".sh.packing-*"))
    assert len(left) == 1 and (left[0] / "index.json").exists() and not (tmp_path / "sh").exists()
    live = tmp_path / ".sh.packing-1"   # a pack writing now: it holds the lock
    live.mkdir()
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        again = cli("data", "pack", tmp_path / "if", tmp_path / "sh")
    finally:
        os.close(fd)
    assert again.returncode == 0, again.stderr
    assert f"removed {left[0]}, left by a data pack that was killed" in again.stdout
    assert sorted(p.name for p in tmp_path.glob(".sh.packing-*")) == [live.name]   # the live one is kept
    assert json.loads((tmp_path / "sh" / "index.json").read_text())["splits"]["train"]["total"] == 24


def test_a_corrupt_image_whose_name_is_not_utf8_is_listed_and_the_run_finishes_and_resumes(cli, tmp_path):
    """Was: every run and every --resume crashed at the end writing corrupt_images.txt (UnicodeEncodeError),
    leaving the list and the plots empty."""
    _tree(tmp_path / "data")
    bad = os.fsencode(tmp_path / "data" / "val" / "a") + b"/bad\xff\xfe name.jpg"   # met by every evaluation
    Path(os.fsdecode(bad)).write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg" * 10)
    data = ["--set", "data.dataset=imagefolder", "--set", f"data.root={tmp_path / 'data'}", *TRAIN]
    run = tmp_path / "run"
    for extra, steps in ((["--set", "train.max_steps=1"], 1), (["--resume"], 3)):   # 24 images, 8 per step
        proc = cli("train", "--run-dir", run, *extra, *data, env=_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (run / "corrupt_images.txt").read_bytes() == bad + b"\n"
        summary = json.loads((run / "summary.json").read_text())
        assert summary["corrupt_images"] == 1 and summary["steps"] == steps
        assert sorted(p.name for p in (run / "plots").iterdir()) == ["batch.png", "loss.png", "lr.png", "top1.png"]
    fail = cli("train", "--run-dir", tmp_path / "run2", *data, "--set", "data.on_corrupt=fail", env=_env())
    line = _one_error(fail)
    assert "bad\\xff\\xfe name.jpg" in line, line   # the bytes that are not UTF-8 shown as \xNN
