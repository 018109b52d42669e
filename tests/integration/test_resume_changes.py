"""What a resume may change (docs/reliability.md, "What a resume may change"), with real runs and files: a change
of what the run is (the global batch, data.root) is refused in one sentence naming the setting, its old and new
value and the fix, leaving the run as it was; a change accepted (train.log_every, data.root with --allow-change)
is recorded in config.yaml and metrics.jsonl and said in one line, and the epochs stay those trained."""
import json
import struct

import numpy as np
import pytest

from largebatch import cli as cli_mod, config

# 64 synthetic images at a global batch of 16: 4 steps per epoch
TINY = ["--set", "model.width=4", "--set", "data.dataset=synthetic", "--set", "data.synthetic_size=64",
        "--set", "data.image_size=8", "--set", "batch.global_batch=16", "--set", "schedule.epochs=2",
        "--set", "schedule.warmup_epochs=0", "--set", "train.plots=false", "--set", "train.threads=1", "--quiet"]


@pytest.fixture
def main(capsys):
    """Run `largebatch ARGS` in this process (a refusal costs no interpreter start); (exit code, stderr)."""
    def run(*args):
        code = cli_mod.main([str(a) for a in args])
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        return code, err
    return run


def _files(run) -> dict:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != ".largebatch.lock"}


def _records(run, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _refused(result, *fragments: str) -> None:
    code, err = result
    assert code == 2, err
    line = [x for x in err.splitlines() if x.startswith("largebatch: error:")]
    assert len(line) == 1, err
    for f in fragments:
        assert f in line[0], line[0]


def test_another_global_batch_on_resume_is_refused_and_the_epochs_stay_those_trained(cli, main, tmp_path):
    """Was: accepted with a generic warning; step 2 at batch 32 counted as epoch 1.0 (0.5 trained), the summary
    claimed the jump and config.yaml kept batch 16."""
    run = tmp_path / "run"
    cli("train", *TINY, "--run-dir", run, "--set", "train.max_steps=2", check=True)
    before = _files(run)
    _refused(main("train", *TINY, "--run-dir", run, "--resume", "--set", "batch.global_batch=32"),
             "batch.global_batch 16 -> 32", "epoch count would jump", "--set batch.global_batch=16", "fresh --run-dir")
    _refused(main("train", *TINY, "--run-dir", run, "--resume", "--set", "batch.global_batch=32",
                  "--allow-change", "batch.global_batch"), "--allow-change batch.global_batch", "fresh --run-dir")
    # a change let through by --allow-change that moves the epoch boundaries is refused all the same
    _refused(main("train", *TINY, "--run-dir", run, "--resume", "--set", "data.synthetic_size=128",
                  "--allow-change", "data.synthetic_size"), "step 2 is epoch 0.25", "epoch count would jump")
    assert _files(run) == before   # nothing written by the refusals
    cli("train", *TINY, "--run-dir", run, "--resume", "--set", "train.max_steps=6", check=True)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["epochs"] == pytest.approx(1.5) and summary["global_batch"] == 16
    assert [r["epoch"] for r in _records(run, "train")][-1] == pytest.approx(1.5)


def test_an_accepted_change_is_recorded_and_said_in_one_line(cli, tmp_path):
    """train.log_every (and train.max_steps) may change on resume: config.yaml holds the new values, metrics.jsonl a
    resume entry with old and new, one line says so. Was: config.yaml kept log_every 1, nothing recorded."""
    run = tmp_path / "run"
    cli("train", *TINY, "--run-dir", run, "--set", "train.max_steps=2", "--set", "train.log_every=1", check=True)
    proc = cli("train", *TINY, "--run-dir", run, "--resume", "--set", "train.max_steps=6", "--set",
               "train.log_every=2", check=True)
    said = [line for line in proc.stderr.splitlines() if "changed settings" in line]
    assert said == [f"largebatch: resuming at step 2 with changed settings: train.log_every 1 -> 2, train.max_steps 2 "
                    f"-> 6 (recorded in {run / 'config.yaml'} and as a resume entry in metrics.jsonl)."], proc.stderr
    assert "warning" not in proc.stderr
    saved = config.load(str(run / "config.yaml"))
    assert (saved.train.log_every, saved.train.max_steps) == (2, 6)
    (entry,) = _records(run, "resume")
    assert entry["step"] == 2 and entry["epoch"] == 0.5
    assert entry["changes"] == {"train.log_every": [1, 2], "train.max_steps": [2, 6]}
    assert [r["step"] for r in _records(run, "train")] == [1, 2, 4, 6]   # the new cadence from the resumed step
    # resumed again with what config.yaml now says: nothing changed, nothing recorded
    proc = cli("train", *TINY, "--run-dir", run, "--resume", "--set", "train.max_steps=6", "--set",
               "train.log_every=2", check=True)
    assert "changed settings" not in proc.stderr and len(_records(run, "resume")) == 1


def _idx(root, train: int, test: int) -> None:
    """A tiny IDX data set (8x8 images, 2 classes) of `train` and `test` images."""
    rng = np.random.default_rng(train + test)
    root.mkdir()
    for split, n in (("train", train), ("t10k", test)):
        for kind, array in (("images-idx3", rng.integers(0, 256, (n, 8, 8), dtype=np.uint8)),
                            ("labels-idx1", np.arange(n, dtype=np.uint8) % 2)):
            header = bytes([0, 0, 8, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
            (root / f"{split}-{kind}-ubyte").write_bytes(header + array.tobytes())


def test_another_data_root_on_resume_is_refused_or_accepted_and_evaluate_uses_it(cli, main, tmp_path):
    """Was: the same generic warning, the run trained on on the new data while config.yaml (and so `evaluate`)
    kept the old root. Now refused naming both roots and the fix; with --allow-change data.root accepted, recorded,
    and `evaluate` scores the new data (24 test images, not the old 16)."""
    old, new = tmp_path / "old", tmp_path / "new"
    _idx(old, 64, 16)
    _idx(new, 64, 24)
    args = [*TINY, "--set", "data.dataset=idx", "--set", "train.eval_every=0"]
    run = tmp_path / "run"
    cli("train", *args, "--run-dir", run, "--set", f"data.root={old}", "--set", "train.max_steps=2", check=True)
    before = _files(run)
    _refused(main("train", *args, "--run-dir", run, "--resume", "--set", f"data.root={new}",
                  "--set", "train.max_steps=3"),
             f"data.root {old} -> {new}", f"--set data.root={old}", "fresh --run-dir", "--allow-change data.root")
    assert _files(run) == before
    proc = cli("train", *args, "--run-dir", run, "--resume", "--set", f"data.root={new}", "--set", "train.max_steps=3",
               "--allow-change", "data.root", check=True)
    assert f"data.root {old} -> {new}" in proc.stderr and "train.max_steps 2 -> 3" in proc.stderr
    assert config.load(str(run / "config.yaml")).data.root == str(new)
    assert _records(run, "resume")[0]["changes"]["data.root"] == [str(old), str(new)]
    assert _records(run, "eval")[-1]["count"] == 24
    evaluated = cli("evaluate", run, check=True)
    assert json.loads(evaluated.stdout.splitlines()[-1])["count"] == 24


@pytest.mark.parametrize("workers", [[], ["--nproc-per-node", "2"]])
def test_missing_data_leaves_no_run_directory(cli, tmp_path, workers):
    """The data is built before the run directory is taken. Was: an empty run directory (a lock file, checkpoints/)
    left behind by every data error."""
    run = tmp_path / "run"
    proc = cli("train", *TINY, "--set", "data.dataset=idx", "--set", f"data.root={tmp_path / 'nowhere'}",
               "--run-dir", run, *workers)
    assert proc.returncode == 2 and proc.stderr.count(f"{tmp_path / 'nowhere'} does not exist") == 1, proc.stderr
    assert not run.exists()
