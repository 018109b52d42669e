"""A full disk (issue 30, category 8): every output a run writes is whole or absent, and the run ends with one
sentence naming the file, exit 2, keeping what it wrote. The disks are real: a small tmpfs (mounting one needs
root; the tests skip saying so where it is not permitted)."""
import json
import os
import subprocess
import zlib
from pathlib import Path

import pytest
import yaml

from largebatch import checkpoint, metrics
from largebatch.errors import UserError

pytestmark = pytest.mark.timeout(300)

TINY = ["fashion_mnist", "--set", "model.width=4", "--set", "data.dataset=synthetic", "--set",
        "data.synthetic_size=256", "--set", "data.image_size=8", "--set", "batch.global_batch=64", "--set",
        "schedule.epochs=1", "--set", "schedule.warmup_epochs=0", "--quiet"]
PAGE = 4096


@pytest.fixture
def small_disk(tmp_path):
    """mount(size): a tmpfs of `size` bytes, unmounted at the end."""
    mounted = []

    def mount(size: int) -> Path:
        mnt = tmp_path / f"disk{len(mounted)}"
        mnt.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            pytest.skip(f"mounting a small tmpfs is not permitted here (needs root): {proc.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", str(mnt)], check=False)


def fill(disk: Path, leave: int) -> Path:
    """Fill `disk` until `leave` bytes (whole pages) are free; the filler's path."""
    st = os.statvfs(disk)
    filler = disk / "filler"
    filler.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - leave))
    return filler


def _png_whole(data: bytes) -> bool:
    """A PNG's signature, then chunks whose CRCs hold, ending with IEND."""
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return False
    at = 8
    while at + 12 <= len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + size]
        if len(body) != size or zlib.crc32(kind + body) != int.from_bytes(data[at + 8 + size:at + 12 + size], "big"):
            return False
        at += 12 + size
        if kind == b"IEND":
            return at == len(data)
    return False


def assert_whole(run: Path) -> list[str]:
    """Every output of the run is whole: no temporary file, no empty file, every file parses (the lock file is
    no output); the names found."""
    names = []
    for path in sorted(run.rglob("*")):
        if path.is_dir() or path.name == ".largebatch.lock":
            continue
        rel = str(path.relative_to(run))
        names.append(rel)
        assert not path.name.startswith(".tmp-"), f"a temporary file stayed behind: {rel}"
        data = path.read_bytes()
        assert data, f"an empty file stayed behind: {rel}"
        if path.suffix == ".json":
            assert isinstance(json.loads(data), dict), rel
        elif path.suffix == ".jsonl":
            assert data.endswith(b"\n"), f"{rel} ends in a torn line"
            for line in data.decode().splitlines():
                assert isinstance(json.loads(line), dict), (rel, line)
        elif path.suffix == ".yaml":
            assert isinstance(yaml.safe_load(data), dict), rel
        elif path.suffix == ".png":
            assert _png_whole(data), f"{rel} is not a whole PNG"
        elif path.suffix == ".pt":
            assert checkpoint.verify(path.with_suffix(".json")) is not None, f"{rel} is not intact"
        elif path.name == checkpoint.MANIFEST:
            assert data.endswith(b"\n"), rel
    return names


def _full_disk_sentence(proc, path: Path) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("largebatch: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"cannot write {path}: No space left on device; free space on that disk" in errors[0], errors[0]
    assert "--resume" in errors[0], errors[0]


@pytest.mark.parametrize("size, fails_at", [
    (96 * 1024, "checkpoints/step-00000004.pt"),   # the checkpoint (181 KB) does not fit
    (200 * 1024, "plots/loss.png"),                # the checkpoint fits; the plots and summary.json do not
])
def test_a_run_on_a_full_disk_ends_in_one_sentence_and_leaves_only_whole_files(cli, small_disk, size, fails_at):
    """Was: 'cannot use: No space left on device' naming no file, and a 0-byte summary.json left behind."""
    run = small_disk(size) / "run"
    proc = cli("train", *TINY, "--run-dir", run, "--set", "train.plots=true", timeout=240)
    _full_disk_sentence(proc, run / fails_at)
    names = assert_whole(run)
    assert "summary.json" not in names and "config.yaml" in names and "metrics.jsonl" in names, names


def test_a_full_disk_mid_line_leaves_metrics_jsonl_whole_and_resume_continues(cli, small_disk):
    """metrics.jsonl reaches a new page of a disk with no page left: the write is cut short mid-line. Was: a torn
    last line (and the next run's first line joined to it), and no file named. Then space is freed and --resume
    finishes the run on the same directory."""
    disk = small_disk(512 * 1024)   # room for a checkpoint once the filler is gone
    run = disk / "run"
    # one page each for the lock file, config.yaml and metrics.jsonl's first page (directories take none)
    filler = fill(disk, 3 * PAGE)
    common = [*TINY, "--run-dir", run, "--set", "train.plots=false", "--set", "batch.global_batch=8",
              "--set", "train.log_every=1"]
    proc = cli("train", *common, timeout=240)
    _full_disk_sentence(proc, run / "metrics.jsonl")
    assert assert_whole(run) == ["config.yaml", "metrics.jsonl"]
    size = (run / "metrics.jsonl").stat().st_size
    assert PAGE - 400 < size <= PAGE, size   # every line that fitted is kept
    filler.unlink()
    proc = cli("train", *common, "--resume", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "summary.json" in assert_whole(run)


def test_evaluate_on_a_full_disk_names_evaluation_json_and_leaves_none(cli, small_disk, tmp_path):
    """evaluate's evaluation.json (was: a 0-byte file and 'cannot use: No space left on device')."""
    trained = tmp_path / "trained"
    cli("train", *TINY, "--run-dir", trained, "--set", "train.plots=false", check=True, timeout=240)
    disk = small_disk(512 * 1024)
    run = disk / "run"
    subprocess.run(["cp", "-a", str(trained), str(run)], check=True)
    fill(disk, 0)
    proc = cli("evaluate", run, timeout=240)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"cannot use {run / 'evaluation.json'}: No space left on device" in proc.stderr, proc.stderr[-3000:]
    assert not (run / "evaluation.json").exists()
    assert not [p for p in run.iterdir() if p.name.startswith(".tmp-")]


def test_evaluate_on_a_read_only_run_directory_says_so_before_any_work_and_writes_to_out(cli, tmp_path):
    """A run directory on a read-only file system (a read-only bind mount: root ignores mode bits): `evaluate`
    refuses at once, naming --out, instead of evaluating and then losing the result; with --out the result goes
    there."""
    trained = tmp_path / "trained"
    cli("train", *TINY, "--run-dir", trained, "--set", "train.plots=false", check=True, timeout=240)
    view = tmp_path / "read-only"
    view.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(trained), str(view)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a bind mount is not permitted here (needs root): {mounted.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
        proc = cli("evaluate", view, timeout=240)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert f"run directory {view} is not writable" in proc.stderr and "give --out FILE" in proc.stderr
        assert "top-1" not in proc.stderr   # said before the evaluation, not after it
        out = tmp_path / "results" / "eval.json"
        proc = cli("evaluate", view, "--out", out, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(out.read_text()) == json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["umount", str(view)], check=False)
    assert not (trained / "evaluation.json").exists()


# ---------------------------------------------------------------------------- the writers and readers
def test_atomic_write_and_append_whole_name_the_path_and_leave_nothing_cut(small_disk):
    disk = small_disk(64 * 1024)
    with pytest.raises(OSError) as err:
        checkpoint.atomic_write(disk / "big.bin", b"x" * (1 << 20))
    assert err.value.filename == str(disk / "big.bin")
    assert list(disk.iterdir()) == []
    log = metrics.MetricsLog(disk / "metrics.jsonl")
    log.write({"kind": "train", "step": 1, "epoch": 0.1, "loss": 1.0})
    fill(disk, 0)
    with pytest.raises(OSError) as err:
        log.write({"kind": "train", "step": 2, "epoch": 0.2, "loss": 0.5, "pad": "x" * 5000})
    log.close()
    assert err.value.filename == str(disk / "metrics.jsonl")
    assert [r["step"] for r in metrics.read(disk / "metrics.jsonl")] == [1]
    assert (disk / "metrics.jsonl").read_bytes().endswith(b"}\n")


def test_readers_skip_a_torn_last_line_and_a_reopened_log_cuts_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "epoch": 0.1, "loss": 1.0}\n{"kind": "train", "st')
    assert [r["step"] for r in metrics.read(path)] == [1]
    log = metrics.MetricsLog(path)   # a resumed run: its first line must not join the torn one
    log.write({"kind": "train", "step": 2, "epoch": 0.2, "loss": 0.5})
    log.close()
    assert [r["step"] for r in metrics.read(path)] == [1, 2]
    assert len(path.read_text().splitlines()) == 2


@pytest.mark.parametrize("line, why", [
    ("[1, 2]", "a JSON list, not an object"),
    ("3", "a JSON int, not an object"),
    ('{"kind": "train", "step": 2, "epoch": 0.2, "loss": "low"}', "its loss is 'low', not a number"),
    ('{"kind": "train", "step": true, "epoch": 0.2, "loss": 1.0}', "its step is True, not a number"),
    ('{"kind": "train", "step": 2, "epoch": 0.2}', "its train record has no loss"),
    ('{"kind": 7, "step": 2}', "its kind is 7"),
])
def test_a_line_that_is_json_but_no_record_is_one_sentence_naming_file_and_line(tmp_path, line, why):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "epoch": 0.1, "loss": 1.0}\n' + line + "\n")
    with pytest.raises(UserError, match=f"{path} line 2 is not a record a largebatch run writes") as err:
        metrics.read(path)
    assert why in str(err.value)
