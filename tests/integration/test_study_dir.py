"""A study directory belongs to one study process (issue 30, 2), and the files a user can edit or damage are named
in one sentence before any work (issue 30, 4): real files, real study processes, real signals."""
import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from largebatch import cli as cli_mod
from largebatch.commands.study import cells as study_cells
from largebatch.commands.study import tuning
from largebatch.commands.study.kinds import KINDS
from largebatch.commands.chaos import _comm, _descendants
from largebatch.errors import UserError
from largebatch.launch import FORKSERVER_NAME

from conftest import proc_alive, proc_holds, proc_ppid

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
TINY = ["--batches", "32", "--optimizers", "sgd", "--nproc-per-node", "1", "--set", "data.dataset=synthetic",
        "--set", "data.synthetic_size=160", "--set", "data.image_size=8", "--set", "model.width=4",
        "--set", "schedule.warmup_epochs=0", "--set", "train.log_every=1"]


def _refused(proc, *words):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for w in words:
        assert w in proc.stderr, proc.stderr


def _until_its_cell_trains(study_proc: subprocess.Popen, out: Path) -> None:
    """Wait (up to 120 s) until the study's one cell has logged a training step, or the study has ended."""
    metrics = out / "runs" / "sgd-b32-s0" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and study_proc.poll() is None:
        if metrics.exists() and '"kind": "train"' in metrics.read_text():
            return
        time.sleep(0.2)


def test_a_running_study_owns_its_out_and_sigterm_leaves_its_cell_resumable(cli, tmp_path):
    """A second study on the --out of a running one is refused naming its pid, touching nothing; SIGTERM to the
    study stops its cell's launcher and its 2 workers (no orphans), records the cell as interrupted, exits 143; run
    again, the study resumes that cell from its checkpoint instead of counting it failed. (The SIGKILL test below
    has a cell of one process.)"""
    out = tmp_path / "study"
    args = ["study", "batch-scaling", *TINY, "--nproc-per-node", "2", "--epochs", "16", "--out", str(out)]   # 80 steps
    # 1 s per step: the cell is still training when the signal comes, however slow the second study's start-up
    # (with 8 slow steps, a loaded machine let the cell finish first)
    slow = {"LARGEBATCH_FAULTS": "hang@0:2-80", "LARGEBATCH_FAULT_HANG_S": "1"}
    # one BLAS thread: the study has one thread and forks its cells' forkserver (launch.fork_forkserver)
    first = subprocess.Popen([sys.executable, "-m", "largebatch", *args], cwd=ROOT,
                             env={**os.environ, **slow, "OMP_NUM_THREADS": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _until_its_cell_trains(first, out)
        assert first.poll() is None, first.communicate()
        settings = (out / "study_settings.json").read_bytes()
        second = cli(*args)
        _refused(second, f"study directory {out} is in use by another largebatch process (pid {first.pid} ",
                 "give another --out")
        assert (out / "study_settings.json").read_bytes() == settings and not (out / "study.json").exists()
        family = _descendants(first.pid)
        assert len(family) >= 3   # the cell's launcher and its 2 workers
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 143, err
    deadline = time.time() + 10
    while time.time() < deadline and any(map(proc_alive, family)):
        time.sleep(0.1)
    assert not [p for p in family if proc_alive(p)], "the cell's launcher or workers outlived the study"
    assert "stopped by signal 15 with a checkpoint" in err and "failed" not in err
    (cell,) = json.loads((out / "study.json").read_text())["cells"]
    assert cell["interrupted"] and cell["top1"] is None
    assert list((out / "runs" / "sgd-b32-s0" / "checkpoints").glob("step-*.json"))
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert "(resuming)" in again.stderr and "failed" not in again.stderr
    assert "resumed from" in (out / "runs" / "sgd-b32-s0" / "train.log").read_text()
    (cell,) = json.loads((out / "study.json").read_text())["cells"]
    assert cell["top1"] is not None and "interrupted" not in cell


def test_a_signal_that_comes_as_a_cell_finishes_leaves_the_cell_done_not_failed(tmp_path):
    """SIGTERM to the study just after its cell wrote summary.json (the cell's launcher, still shutting down,
    then exits 143; 2 workers, so that there is a launcher): the cell is done, with its result, and nothing is
    called failed."""
    out = tmp_path / "study"
    summary = out / "runs" / "sgd-b32-s0" / "summary.json"
    study = subprocess.Popen([sys.executable, "-m", "largebatch", "study", "batch-scaling", *TINY, "--nproc-per-node",
                              "2", "--epochs", "2", "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        deadline = time.time() + 180
        while not summary.exists() and study.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        assert summary.exists(), study.communicate()
        study.send_signal(signal.SIGTERM)
        _, err = study.communicate(timeout=120)
    finally:
        if study.poll() is None:
            os.killpg(study.pid, signal.SIGKILL)
    assert "failed" not in err, err
    (cell,) = json.loads((out / "study.json").read_text())["cells"]
    assert cell["top1"] is not None and "interrupted" not in cell
    if study.returncode == 143:   # the signal came before the study's end (0: after it)
        assert "before signal 15 reached it" in err and "stopped by signal 15" in err, err
    else:
        assert study.returncode == 0, err


def test_a_sigkilled_study_takes_its_cell_with_it_and_the_cell_resumes(cli, tmp_path):
    """SIGKILL cannot be caught, so the study cannot forward it: its cell (one process here: --nproc-per-node 1
    trains in the cell's process; a launcher does the same and stops its workers) asked the kernel for SIGTERM
    when its parent, the study's forkserver, dies with the study (LARGEBATCH_STUDY_PID, PR_SET_PDEATHSIG), stops
    with a checkpoint and exits; no process of the cell outlives the study for long, and a new study resumes the
    cell."""
    out = tmp_path / "study"
    args = ["study", "batch-scaling", *TINY, "--epochs", "16", "--out", str(out)]   # 80 steps
    slow = {"LARGEBATCH_FAULTS": "hang@0:2-80", "LARGEBATCH_FAULT_HANG_S": "1"}   # 1 s per step: ~80 s to go
    # one BLAS thread: the study has one thread and forks its cells' forkserver (launch.fork_forkserver)
    first = subprocess.Popen([sys.executable, "-m", "largebatch", *args], cwd=ROOT,
                             env={**os.environ, **slow, "OMP_NUM_THREADS": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    family: list[int] = []
    try:
        _until_its_cell_trains(first, out)
        assert first.poll() is None
        family = _descendants(first.pid)
        # started warm: forked from the study's forkserver (cells.start_cell), in a session of its own, as the
        # forkserver is; its death (the study's, through the forkserver's "alive" pipe) is the cell's signal
        (server,) = [p for p in family if proc_ppid(p) == first.pid and _comm(p) == FORKSERVER_NAME]
        (cell,) = [p for p in family if proc_ppid(p) == server]
        assert os.getsid(server) == server and os.getsid(cell) == cell
        assert "libtorch_cpu.so" in Path(f"/proc/{server}/maps").read_text()   # a fork of the study, torch imported
        lock = str(out / ".largebatch.lock")   # the study's flock: the forkserver, a fork, holds none of its files
        assert proc_holds(first.pid, lock) and not proc_holds(server, lock)
        first.kill()
        first.wait(timeout=30)
        deadline = time.time() + 40   # far less than the cell's remaining training: it stopped, not finished
        while time.time() < deadline and any(map(proc_alive, family)):
            time.sleep(0.2)
        assert not [p for p in family if proc_alive(p)], "the cell's process outlived the SIGKILLed study"
    finally:
        for pid in [p for p in family if proc_alive(p)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert list((out / "runs" / "sgd-b32-s0" / "checkpoints").glob("step-*.json"))   # stopped with a checkpoint
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert "(resuming)" in again.stderr and "failed" not in again.stderr
    (cell,) = json.loads((out / "study.json").read_text())["cells"]
    assert cell["top1"] is not None


def test_a_study_takes_no_directory_of_a_training_run_or_of_other_files(cli, tmp_path):
    """--out holding a training run, or a user's own study.md, is refused before any cell trains; nothing in it
    changes and nothing is added."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {width: 4}\n")
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "study.md").write_text("my own notes\n")
    for out, words in ((run, ["holds a training run (config.yaml, metrics.jsonl)"]),
                       (mine, ["holds files that are not a largebatch study's (study.md)", "give a new or empty"])):
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        for kind in (["batch-scaling", *TINY, "--epochs", "1"],
                     ["batch-control", "--batch", "64", "--start-batch", "32", "--switch-epochs", "1", "--epochs", "2",
                      "--seeds", "1", *TINY[4:]]):
            _refused(cli("study", *kind, "--out", out), f"--out {out} ", *words)
            assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_damaged_study_json_or_summary_is_named_before_any_cell_trains(cli, tmp_path, capsys):
    """A study.json cut short or of another shape, a cell's summary.json cut short or hand-edited: one sentence
    naming the file, exit 2, and every file as it was (the study neither trains nor rewrites anything)."""
    out = tmp_path / "study"
    args = ["study", "batch-scaling", *TINY, "--epochs", "1", "--out", out]
    cli(*args, check=True)
    summary = out / "runs" / "sgd-b32-s0" / "summary.json"
    good_json, good_summary = (out / "study.json").read_bytes(), summary.read_bytes()

    def files():
        return {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".largebatch.lock"}

    for path, damaged, words in (
            (out / "study.json", good_json[:len(good_json) // 2], ["is not readable JSON", "move it away"]),
            (out / "study.json", b'{"cells": {"run_dir": 1}}', ["is not a study's study.json"]),
            (out / "study.json", b"[1, 2]", ["is not a study's study.json"]),
            (summary, good_summary[:len(good_summary) // 2], ["is not readable JSON", "restore it"]),
            (summary, json.dumps({**json.loads(good_summary), "final_top1": "0.9"}).encode(),
             ["has final_top1 '0.9', not a top-1 between 0 and 1"]),
            (summary, json.dumps({**json.loads(good_summary), "final_top1": 93.5}).encode(), ["has final_top1 93.5"]),
            (summary, b"[]", ["is not a run's summary (a JSON list)"])):
        path.write_bytes(damaged)
        before = files()
        code = cli_mod.main([str(a) for a in args])   # in this process: the refusal comes before any cell
        _refused(subprocess.CompletedProcess(args, code, "", capsys.readouterr().err), f"{path} ", *words)
        assert files() == before
        path.write_bytes(good_json if path.name == "study.json" else good_summary)


def test_a_study_reads_a_diverged_cell_from_its_summary_status(tmp_path):
    """A cell whose training diverges (the fault knob poisons every step) writes summary.json with status diverged
    and the trainer's sentence; the study counts it as a result (diverged, no top-1), not a failure, and a
    re-run takes it as done. A status that is neither finished nor diverged is one sentence naming the file."""
    out = tmp_path / "study"
    args = [sys.executable, "-m", "largebatch", "study", "batch-scaling", *TINY, "--set", "train.max_nonfinite=1",
            "--epochs", "1", "--lr-grid", "sgd:0.1", "--val-split", "32", "--out", str(out)]
    env = {**os.environ, "LARGEBATCH_FAULTS": "nan@0:0-99"}
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0 and "lr 0.1 seed 0 diverged" in proc.stderr, proc.stdout + proc.stderr
    summary = json.loads((out / "runs" / "sgd-b32-lr0.1-s0" / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["reason"].startswith("training diverged: 2 consecutive")
    cells = json.loads((out / "study.json").read_text())["cells"]
    assert [(c["diverged"], c["top1"]) for c in cells] == [(True, None)]
    again = subprocess.run(args, capture_output=True, text=True, env=env, timeout=240)
    assert again.returncode == 0 and "study cell" not in again.stderr, again.stderr   # done: not trained again
    with pytest.raises(UserError, match="has status 'exploded', not one of finished, diverged"):
        path = out / "runs" / "sgd-b32-lr0.1-s0" / "summary.json"
        path.write_text(json.dumps({**summary, "status": "exploded"}))
        study_cells.read_summary(path)


def _tuning(tmp_path: Path, name: str, row: dict) -> Path:
    (tmp_path / name).mkdir()
    table = {"sgd@32/lr0.1": {"batch": 32, "optimizer": "sgd", "lr": 0.1, "top1_mean": 0.7, **row}}
    (tmp_path / name / "study.json").write_text(json.dumps({"val_split": 32, "table": table}))
    return tmp_path / name


def test_a_tuning_table_with_a_string_where_a_number_belongs_is_one_sentence(cli, tmp_path):
    for name, row, words in (("top1", {"top1_mean": "0.7"}, "has top1_mean '0.7' in its table row 'sgd@32/lr0.1'"),
                             ("lr", {"lr": "0.1"}, "has lr '0.1'"), ("batch", {"batch": "32"}, "has batch '32'"),
                             ("bool", {"batch": True}, "has batch True")):
        tuned = _tuning(tmp_path, name, row)
        with pytest.raises(UserError, match="restore that study.json"):
            tuning.chosen_lrs_of([tuned], KINDS["batch-scaling"])
        proc = cli("study", "batch-scaling", *TINY, "--epochs", "1", "--from-tuning", tuned, "--dry-run",
                   "--out", tmp_path / "final")
        _refused(proc, f"--from-tuning: {tuned / 'study.json'} ", words)
    variants = tmp_path / "variants"
    variants.mkdir()
    (variants / "study.json").write_text(json.dumps({"kind": "batch-control", "val_split": 32, "table": {
        "fixed": {"lr": "0.1", "top1_mean": 0.7}, "control": {"lr": 0.2, "top1_mean": 0.8}}}))
    proc = cli("study", "batch-control", "--batch", "64", "--start-batch", "32", "--switch-epochs", "1", "--epochs",
               "2", "--seeds", "1", *TINY[4:], "--from-tuning", variants, "--dry-run", "--out", tmp_path / "bc")
    _refused(proc, f"--from-tuning: {variants / 'study.json'} has lr '0.1' for variant 'fixed'")


class _Payload:
    """A pickle that would create a file if it were ever unpickled with code allowed."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _snapshot(directory: Path, step: int, data: bytes) -> Path:
    import hashlib

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{step:08d}.pt"
    path.write_bytes(data)
    meta = {"step": step, "file": path.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "epoch": 1.0, "kind": "snapshot"}   # intact by its own metadata: only loading can tell
    path.with_suffix(".json").write_text(json.dumps(meta))
    return path


def test_evaluate_ensemble_names_a_foreign_or_malicious_snapshot(cli, tmp_path):
    """A file in snapshots/ that is no snapshot of the run's model, even with metadata that checks out: one sentence
    naming it, exit 2, no code from it run."""
    import io

    import torch

    from largebatch import config as config_mod

    run = tmp_path / "run"
    run.mkdir()
    config_mod.save(config_mod.load("fashion_mnist", ["data.dataset=synthetic", "data.synthetic_size=64",
                                                      "data.image_size=8", "model.width=4"]), run / "config.yaml")
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"x": torch.zeros(1)}, buf)
    for data, words in ((pickle.dumps(_Payload(marker)), "torch.load failed"),
                        (b"not a torch file at all", "torch.load failed"),
                        (buf.getvalue(), "no model state in it")):
        bad = _snapshot(run / "snapshots", 1, data)
        _refused(cli("evaluate", run, "--ensemble"), f"snapshot {bad} is not a largebatch snapshot of this run",
                 words, f"move it and its .json out of {run / 'snapshots'}")
        assert not marker.exists()
    buf = io.BytesIO()
    torch.save({"model": {"fc.weight": torch.zeros(3, 3)}, "step": 1}, buf)
    bad = _snapshot(run / "snapshots", 1, buf.getvalue())
    _refused(cli("evaluate", run, "--ensemble"), f"checkpoint {bad} does not fit this run's model")


def test_chaos_refuses_a_damaged_baseline_or_one_of_another_recipe_before_any_work(cli, tmp_path):
    from largebatch import config as config_mod

    tiny = ["data.dataset=synthetic", "data.synthetic_size=64", "data.image_size=8", "model.width=4"]
    base = tmp_path / "base"
    base.mkdir()
    config_mod.save(config_mod.load("fashion_mnist", tiny + ["train.log_every=50"]), base / "config.yaml")
    sets = [x for kv in tiny for x in ("--set", kv)]
    out = tmp_path / "chaos"
    summary = {"final_top1": 0.5, "steps": 4, "world_size": 2}
    for text, words in (('{"final_top1": 0.5, "st', "is not readable JSON"),
                        (json.dumps({**summary, "final_top1": "0.5"}), "has final_top1 '0.5'")):
        (base / "summary.json").write_text(text)
        _refused(cli("chaos", *sets, "--kills", "1", "--out", out, "--baseline-dir", base, timeout=60),
                 f"--baseline-dir: {base / 'summary.json'} ")
        assert not out.exists()
    (base / "summary.json").write_text(json.dumps(summary))
    other = ["--set", "model.width=8", *sets[:-2]]   # the same recipe but a wider model
    _refused(cli("chaos", *other, "--kills", "1", "--out", out, "--baseline-dir", base, timeout=60),
             f"--baseline-dir {base} is a run of other settings", "model.width 8 vs 4")
    (base / "summary.json").write_text(json.dumps({**summary, "world_size": 1}))
    _refused(cli("chaos", *sets, "--kills", "1", "--out", out, "--baseline-dir", base, timeout=60),
             "2 workers vs 1")
    assert not out.exists()
