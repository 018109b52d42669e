"""A run writes and deletes only what it created, inside its own directory (largebatch/rundir.py steps 7-8,
largebatch/checkpoint.py step 7): system directories, the home directory and directories of other files are
not taken over; symbolic links among a run's own names are refused, never written through; pruning deletes
only the checkpoints the run recorded. Real files, real links, and the CLI as a user runs it."""
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import user_error as _user_error
from largebatch import checkpoint, metrics, rundir
from largebatch.errors import UserError

pytestmark = pytest.mark.timeout(300)

TINY = ["--set", "model.width=4", "--set", "data.dataset=synthetic", "--set", "data.synthetic_size=256",
        "--set", "data.image_size=8", "--set", "batch.global_batch=64", "--set", "schedule.epochs=1",
        "--set", "schedule.warmup_epochs=0", "--set", "train.plots=false", "--quiet"]


def _tree(root: Path) -> dict:
    """Every entry under `root` (links as links, not followed) with its content or link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = ("link", os.readlink(p)) if p.is_symlink() else ("dir",) if p.is_dir() else p.read_bytes()
    return out


def _foreign_checkpoint(directory: Path, step: int) -> None:
    """A checkpoint pair with valid metadata that this directory's writer did not write (copied in by hand)."""
    elsewhere = directory.parent / f"elsewhere-{step}"
    checkpoint.save({"w": torch.zeros(3)}, elsewhere, step)
    for suffix in (".pt", ".json"):
        name = f"step-{step:08d}{suffix}"
        (directory / name).write_bytes((elsewhere / name).read_bytes())


# ---------------------------------------------------------------------------- what a run may take (step 7)
@pytest.mark.parametrize("path", ["/", "/etc", "/usr", "/usr/lib", "/etc/largebatch-new", "/home", "/tmp", "/var",
                                  "/proc/self"])
def test_system_directories_are_refused_without_writing(path):
    before = sorted(os.listdir(path)) if Path(path).is_dir() and path != "/proc/self" else None
    with pytest.raises(UserError, match="is a system directory; give a directory of its own"):
        rundir.check(Path(path), resume=False)
    with pytest.raises(UserError, match="is a system directory"):
        rundir.check(Path(path), resume=True)
    with pytest.raises(UserError, match="is a system directory"):
        rundir.claim(Path(path), resume=True)   # refused before it creates or locks anything
    assert not Path("/etc/largebatch-new").exists()
    if before is not None:
        assert sorted(os.listdir(path)) == before


def test_a_link_to_a_system_directory_and_the_home_directory_are_refused(tmp_path, monkeypatch):
    link = tmp_path / "run"
    link.symlink_to("/etc")
    for refuse in (rundir.check, rundir.claim):   # check first: it creates nothing, even where this would fail
        with pytest.raises(UserError, match=f"{link} \\(which leads to /etc\\) is a system directory"):
            refuse(link, resume=True)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))   # Path.home()
    with pytest.raises(UserError, match="is your home directory"):
        rundir.claim(home, resume=False)    # even empty
    assert list(home.iterdir()) == []
    rundir.claim(home / "runs" / "a", resume=False).release()   # a directory under it is fine


def test_a_study_out_is_no_system_or_home_directory(tmp_path, monkeypatch, capsys):
    """A study's --out (it creates run directories under it) is checked before any work, in a dry run too (in
    this process: the refusal comes before anything starts)."""
    from largebatch import cli as cli_mod

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for command in (["study", "batch-scaling"], ["study", "batch-control"]):
        for out, fragment in (("/", "--out / is a system directory"), ("/etc", "--out /etc is a system directory"),
                              (home, "is your home directory")):
            code = cli_mod.main([*command, "--out", str(out), "--dry-run"])
            _user_error(subprocess.CompletedProcess(command, code, "", capsys.readouterr().err), fragment)
    assert list(home.iterdir()) == []


def test_a_directory_of_other_files_is_not_taken_over(cli, tmp_path):
    """A user's directory (a project, a home, runs/ holding other runs) is refused by the launcher and by a single
    process alike, with and without --resume; nothing is written into it, not even the lock file."""
    mine = tmp_path / "project"
    (mine / "data").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    (mine / "data" / "x.csv").write_text("1,2\n")
    before = _tree(mine)
    for extra in ([], ["--resume"], ["--nproc-per-node", "2"]):
        _user_error(cli("train", *TINY, "--run-dir", mine, *extra), f"--run-dir {mine} holds files that are not a "
                    "largebatch run's (data, notes.txt)", "give a new or empty --run-dir")
    assert _tree(mine) == before
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("# mine\n")
    _user_error(cli("train", *TINY, "--run-dir", home, env={"HOME": str(home)}), "is your home directory")
    assert _tree(home) == {".bashrc": b"# mine\n"}


def test_what_a_run_or_its_caller_leaves_is_taken(tmp_path):
    """Allowed: an empty directory, one holding only a caller's log (a study cell's train.log) or what a run
    killed at its start leaves (the lock, an empty checkpoints/), and with --resume a run holding a user's file."""
    cell = tmp_path / "cell"
    cell.mkdir()
    (cell / "train.log").write_text("study: starting\n")
    rundir.claim(cell, resume=False).release()
    started = tmp_path / "started"
    (started / "checkpoints").mkdir(parents=True)
    (started / rundir.LOCK).write_text("pid 1 on host")
    rundir.claim(started, resume=False).release()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    (run / "analysis.ipynb").write_text("{}")
    rundir.claim(run, resume=True).release()   # it holds a run: it belongs to the run, the notebook stays
    assert (run / "analysis.ipynb").read_text() == "{}"


# ---------------------------------------------------------------------------- no symbolic links (step 8)
def test_a_symlinked_checkpoints_directory_is_refused_and_nothing_there_is_pruned(cli, tmp_path):
    """The reported case: checkpoints/ a link to another directory, and pruning deleted a file there."""
    run = tmp_path / "run"
    cli("train", *TINY, "--run-dir", run, check=True)
    elsewhere = tmp_path / "elsewhere"
    (run / "checkpoints").rename(elsewhere)
    (run / "checkpoints").symlink_to(elsewhere)
    _foreign_checkpoint(elsewhere, 1)   # named like one of the run's, not written by it
    (elsewhere / "results.txt").write_text("someone else's")
    before, run_before = _tree(elsewhere), _tree(run)
    for extra in ([], ["--nproc-per-node", "2"]):
        _user_error(cli("train", *TINY, "--set", "train.keep_checkpoints=1", "--set", "schedule.epochs=3",
                        "--run-dir", run, "--resume", *extra),
                    f"{run / 'checkpoints'} is a symbolic link to {elsewhere}", "replace the link by a real directory")
    assert _tree(elsewhere) == before and _tree(run) == run_before


@pytest.mark.parametrize("name", ["snapshots", "plots", "tensorboard", "checkpoints"])
def test_a_symlinked_sub_directory_of_a_new_run_is_refused(tmp_path, name):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (run / name).symlink_to(elsewhere)
    for resume in (False, True):
        with pytest.raises(UserError, match=f"{name} is a symbolic link to {elsewhere}"):
            rundir.claim(run, resume=resume)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("name", [rundir.LOCK, "metrics.jsonl", "config.yaml", "summary.json", "corrupt_images.txt",
                                  "checkpoints/step-00000099.json", "checkpoints/step-00000004.pt",
                                  f"checkpoints/{checkpoint.MANIFEST}", "plots/loss.png"])
def test_a_file_name_of_the_run_that_is_a_symlink_is_refused(tmp_path, name):
    """The run's own file names as links (a dangling one too): refused before the lock file is opened, which
    would truncate and write the link's target."""
    run, victim = tmp_path / "run", tmp_path / "victim.txt"
    (run / "checkpoints").mkdir(parents=True)
    (run / "plots").mkdir()
    (run / "metrics.jsonl").write_text("")   # a run, resumed
    if name != "metrics.jsonl":
        victim.write_text("precious")
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(victim)
    with pytest.raises(UserError, match=f"{run / name} is a symbolic link to {victim}, and a run writes only "
                                        "inside its own directory"):
        rundir.claim(run, resume=True)
    assert (victim.read_text() == "precious") if name != "metrics.jsonl" else not victim.exists()


def test_the_writers_refuse_links_that_appear_during_the_run(tmp_path):
    """The writers' side (O_NOFOLLOW, no linked sub-directory), for a link made after the run took its
    directory: metrics.jsonl, summary.json, plots/, tensorboard/, a checkpoint directory, a lock file."""
    run, elsewhere, victim = tmp_path / "run", tmp_path / "elsewhere", tmp_path / "victim.txt"
    run.mkdir()
    elsewhere.mkdir()
    victim.write_text("precious")
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(UserError, match="metrics.jsonl is a symbolic link"):
        metrics.MetricsLog(run / "metrics.jsonl").write({"kind": "train"})
    (run / "metrics.jsonl").unlink()
    metrics.MetricsLog(run / "metrics.jsonl").write({"kind": "train", "step": 1, "epoch": 0.1, "loss": 1.0, "lr": 0.1,
                                                     "global_batch": 8})
    (run / "summary.json").symlink_to(victim)
    with pytest.raises(UserError, match="summary.json is a symbolic link"):
        metrics.write_outputs(run, {"steps": 1}, [], plots=False, tensorboard=False)
    (run / "summary.json").unlink()
    (run / "plots").symlink_to(elsewhere)
    with pytest.raises(UserError, match="plots is a symbolic link"):
        metrics.write_outputs(run, {"steps": 1}, [], plots=True, tensorboard=False)
    (run / "plots").unlink()
    (run / "plots").mkdir()
    (run / "plots" / "loss.png").symlink_to(victim)
    with pytest.raises(UserError, match="loss.png is a symbolic link"):
        metrics.plot(metrics.read(run / "metrics.jsonl"), run / "plots")
    (run / "tensorboard").symlink_to(elsewhere)
    with pytest.raises(UserError, match="tensorboard is a symbolic link"):
        metrics.write_tensorboard(run)
    (run / "snapshots").symlink_to(elsewhere)
    with pytest.raises(UserError, match="snapshots is a symbolic link"):
        checkpoint.save({"w": torch.zeros(1)}, run / "snapshots", 1)
    assert victim.read_text() == "precious" and list(elsewhere.iterdir()) == []


# ---------------------------------------------------------------------------- what pruning deletes
def test_pruning_deletes_only_the_checkpoints_the_run_wrote(tmp_path):
    ckpts, victim = tmp_path / "checkpoints", tmp_path / "victim.pt"
    ckpts.mkdir()
    victim.write_bytes(b"precious")
    _foreign_checkpoint(ckpts, 1)                              # copied in by hand: intact metadata, not ours
    (ckpts / "step-00000000.pt").symlink_to(victim)           # a link named like a checkpoint
    old = time.time() - 3600
    for name in (".tmp-notes", ".tmp-step-00000001.pt-123"):   # a user's file; our writer's leftover
        (ckpts / name).write_text("x")
        os.utime(ckpts / name, (old, old))
    for step in (2, 3, 4, 5):
        checkpoint.save({"w": torch.full((3,), float(step))}, ckpts, step, keep=2)
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == [checkpoint.MANIFEST, ".tmp-notes", "step-00000000.pt", "step-00000001.json",
                     "step-00000001.pt", "step-00000004.json", "step-00000004.pt", "step-00000005.json",
                     "step-00000005.pt"], names
    assert victim.read_bytes() == b"precious"
    assert checkpoint.recorded(ckpts) == {"step-00000004.pt", "step-00000004.json", "step-00000005.pt",
                                          "step-00000005.json"}   # pruned names are forgotten
    # a file put later under a name the run wrote and pruned is not the run's
    (ckpts / "step-00000002.json").write_text(json.dumps({"step": 2}))
    checkpoint.save({"w": torch.zeros(3)}, ckpts, 6, keep=2)
    assert (ckpts / "step-00000002.json").exists() and (ckpts / "step-00000001.pt").exists()
    assert not (ckpts / "step-00000004.pt").exists() and (ckpts / "step-00000005.pt").exists()


def test_a_resumed_run_prunes_its_own_checkpoints_and_keeps_a_copied_in_one(cli, tmp_path):
    """End to end: a checkpoint copied into checkpoints/ by hand outlives train.keep_checkpoints=1."""
    run = tmp_path / "run"
    cli("train", *TINY, "--set", "train.keep_checkpoints=1", "--run-dir", run, check=True)
    ckpts = run / "checkpoints"
    _foreign_checkpoint(ckpts, 1)
    (ckpts / "step-00000001.json").write_text(json.dumps({**json.loads((ckpts / "step-00000001.json").read_text()),
                                                          "note": "kept by hand"}))
    copied = {n: (ckpts / n).read_bytes() for n in ("step-00000001.pt", "step-00000001.json")}
    cli("train", *TINY, "--set", "train.keep_checkpoints=1", "--set", "schedule.epochs=3", "--run-dir", run,
        "--resume", check=True)
    ours = sorted(p.name for p in ckpts.glob("step-*.json") if p.name != "step-00000001.json")
    assert ours == ["step-00000012.json"], ours
    assert {n: (ckpts / n).read_bytes() for n in copied} == copied
