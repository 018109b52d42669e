"""User errors that need real processes: launchers, ranks, rendezvous, full disks, checkpoints on disk."""
import io
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from test_user_errors import BILLION_LAUGHS, TINY, _expect, _files  # the helpers of its unit tests, one copy

from largebatch import checkpoint
from largebatch.data.pack import pack

pytestmark = pytest.mark.timeout(300)


def test_a_node_that_waits_alone_at_the_rendezvous_is_told_how_to_start_the_others(tmp_path):
    """One agent of an --nnodes 2 run (the others never started, or with another --nnodes or endpoint):
    after the join timeout, one sentence naming the endpoint and the fix, exit 2, no traceback."""
    from largebatch.launch import free_port

    port = free_port()
    r = subprocess.run([sys.executable, "-m", "largebatch.launch", "--nnodes", "2", "--nproc-per-node", "1",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                        "--rdzv-conf", "join_timeout=2", "--local-addr", "127.0.0.1",
                        "-m", "largebatch", "train", *TINY],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"largebatch: error: not all of the --nnodes 2 nodes reached the rendezvous at 127.0.0.1:{port} in time; "
        "start the same command on every node, with the same --nnodes, --rdzv-endpoint and --rdzv-id."], r.stderr
    assert not list(tmp_path.iterdir())   # no worker started, nothing written


def test_checkpoints_that_do_not_fit(cli, main, tmp_path):
    run = tmp_path / "run"
    cli("train", *TINY, "--run-dir", run, check=True)
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()}
    # resume with another model, another optimizer: the sentence names what differs, nothing is touched (and with
    # --allow-change, the checkpoint that does not fit is named)
    _expect(main("train", *TINY, "--set", "model.width=8", "--run-dir", run, "--resume"),
            "would change what the run is: model.width 4 -> 8", "--allow-change model.width")
    _expect(main("train", *TINY, "--set", "model.width=8", "--run-dir", run, "--resume", "--allow-change",
                 "model.width"), "was written by model speedrun", "18,804 parameters", "this run builds",
            "73,896 parameters", "recipe and --set options the run was started with")
    _expect(main("train", *TINY, "--set", "optim.name=lamb", "--run-dir", run, "--resume"),
            "optim.name sgd -> lamb")
    _expect(main("train", *TINY, "--set", "optim.name=lamb", "--run-dir", run, "--resume", "--allow-change",
                 "optim.name"), "was written with optim.name=sgd but this run uses lamb")
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()} == before
    # evaluate --checkpoint: a foreign file, a directory, another run's model
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"junk")
    _expect(main("evaluate", run, "--checkpoint", junk), "is not a largebatch checkpoint")
    _expect(main("evaluate", run, "--checkpoint", tmp_path), "is a directory")
    # a damaged copy (one byte flipped, its .json beside it) and a copy without its .json: refused, not evaluated
    own, _ = checkpoint.latest(run / "checkpoints")
    damaged = tmp_path / "damaged" / own.name
    damaged.parent.mkdir()
    data = bytearray(own.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    damaged.with_suffix(".json").write_bytes(own.with_suffix(".json").read_bytes())
    _expect(main("evaluate", run, "--checkpoint", damaged), "is damaged", "does not match the size and checksum")
    alone = tmp_path / "alone.pt"
    alone.write_bytes(own.read_bytes())
    _expect(main("evaluate", run, "--checkpoint", alone), "has no alone.json beside it", "copy it with its .json")
    other = tmp_path / "other"
    cli("train", *TINY, "--set", "model.width=8", "--run-dir", other, check=True)
    path, _ = checkpoint.latest(other / "checkpoints")
    _expect(main("evaluate", run, "--checkpoint", path), "was written by model speedrun", "73,896 parameters",
            "but the run's config builds", "18,804 parameters", f"give a checkpoint written by the run in {run}")


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
            pack(src, mnt / "shards", shard_bytes=1 << 20)
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


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


def test_resume_with_foreign_checkpoints_or_ema_turned_on(cli, main, tmp_path):
    import hashlib

    import torch

    run = tmp_path / "run"
    cli("train", *TINY, "--run-dir", run, check=True)
    ckpts = run / "checkpoints"
    newest, _ = checkpoint.latest(ckpts)
    # train.ema turned on when resuming a finished run: the average is the restored weights (was: the initial ones)
    assert main("train", *TINY, "--set", "train.ema=0.9", "--run-dir", run, "--resume")[0] == 0
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert len(evals) == 2 and evals[1]["loss"] == evals[0]["loss"]
    # a foreign JSON file among the metadata is skipped like a corrupt one (was: a traceback)
    shutil.copy(newest, ckpts / "step-00000098.pt")
    (ckpts / "step-00000098.json").write_text("[1, 2]")
    warned: list[str] = []
    assert checkpoint.latest(ckpts, warn=warned.append)[0] == newest and "step-00000098.pt" in warned[0]
    before = _files(run)

    def foreign(data: bytes, *fragments: str) -> None:   # a file whose metadata matches it: intact, not ours
        (ckpts / "step-00000099.pt").write_bytes(data)
        (ckpts / "step-00000099.json").write_text(json.dumps({"step": 99, "size": len(data),
                                                               "sha256": hashlib.sha256(data).hexdigest()}))
        _expect(main("train", *TINY, "--run-dir", run, "--resume"), "step-00000099.pt is not a largebatch training "
                "checkpoint", "move it and its .json out of", *fragments)
        (ckpts / "step-00000099.pt").unlink()
        (ckpts / "step-00000099.json").unlink()
        assert _files(run) == before

    foreign(b"junk", "torch.load failed")
    buf = io.BytesIO()
    torch.save({"weights": torch.zeros(2)}, buf)
    foreign(buf.getvalue(), "(no model)")


@pytest.mark.timeout(60)
def test_a_recipe_of_nested_aliases_is_refused_before_it_expands(tmp_path, cli):
    recipe = tmp_path / "laughs.yaml"
    recipe.write_text(BILLION_LAUGHS)   # 10^9 values if built
    proc = cli("train", recipe, "--dry-run", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"recipe {recipe} expands to more than 100,000 values through its aliases" in proc.stderr
    (tmp_path / "loop.yaml").write_text("model: &m {name: resnet18, more: *m}\n")
    proc = cli("train", tmp_path / "loop.yaml", "--dry-run", timeout=60)
    assert proc.returncode == 2 and "an alias that refers to itself" in proc.stderr, proc.stderr[-2000:]
    proc = cli("train", "fashion_mnist", "--dry-run", "--set", "model.x=[&a [1,1,1,1,1,1,1,1,1,1], "
               + ", ".join(["*a"] * 10) + "]", timeout=60)
    assert proc.returncode == 2   # small expansions load as before (and the unknown key is then refused)
    assert "expands" not in proc.stderr and "model.x" in proc.stderr


@pytest.mark.timeout(120)
def test_the_fault_knobs_own_variables_never_stop_a_run_that_uses_none(tmp_path, cli):
    proc = cli("train", "fashion_mnist", "--run-dir", tmp_path / "run", "--set", "data.dataset=synthetic",
               "--set", "train.max_steps=1", "--set", "model.width=4", "--set", "data.synthetic_size=64",
               "--set", "train.plots=false", "--set", "batch.global_batch=32", env={"LARGEBATCH_FAULT_HANG_S": "soon"},
               timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_plain_run_in_a_stale_launcher_environment_is_refused_at_once(tmp_path, cli):
    """`largebatch train` (no --nproc-per-node) in a shell with an earlier job's RANK, WORLD_SIZE and MASTER_*: one
    sentence naming them, exit 2, before any wait for peers; nothing written."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    proc = cli("train", "fashion_mnist", "--run-dir", tmp_path / "run", "--set", "data.dataset=synthetic",
               "--set", "train.max_steps=1", "--set", "comm.timeout_s=600", env=env, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("the environment holds RANK=1, WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, MASTER_PORT=29999 but no torchrun "
            "started this process") in proc.stderr and "'unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT'" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env, sentence", [
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK is set ('0') but WORLD_SIZE is not"),
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "RANK": "0", "TORCHELASTIC_RUN_ID": "x"},
     "--nproc-per-node 2 was given to a process that a launcher started with 1 process(es) per node"),
    # a shell that still holds an earlier job's torchrun variables: it used to run as rank 0 of 2 and wait for
    # comm.timeout_s (10 minutes) for a peer that never came
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
     "the environment holds RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR=127.0.0.1, MASTER_PORT=29999 but no "
     "torchrun started this process (it sets TORCHELASTIC_RUN_ID for its workers), so they are left from an earlier "
     "job; run 'unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT' and start again (--nproc-per-node 2 then "
     "starts its own workers)."),
])
def test_nproc_per_node_that_a_launch_would_ignore_is_refused(tmp_path, cli, env, sentence):
    proc = cli("train", "fashion_mnist", "--nproc-per-node", "2", "--run-dir", tmp_path / "run", "--set",
               "data.dataset=synthetic", "--set", "train.max_steps=1", env=env, timeout=120)
    assert proc.returncode == 2 and sentence in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()   # refused before the run directory is taken



@pytest.mark.timeout(120)
@pytest.mark.parametrize("shadow", ["yaml.py", "numpy/__init__.py"])
def test_a_file_that_shadows_a_dependency_is_one_sentence(tmp_path, shadow):
    """`python -m largebatch` in a directory holding a yaml.py (or a numpy/ package) of the user's: Python would
    import it in the installed package's place and fail deep inside with a traceback; one sentence names it."""
    import subprocess
    import sys

    path = tmp_path / shadow
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("raise RuntimeError('not the real package')\n")
    proc = subprocess.run([sys.executable, "-m", "largebatch", "config", "train.seed"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=100)
    shown = path if path.name != "__init__.py" else path.parent
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{shown} is imported as the package {shown.stem} that largebatch needs" in proc.stderr
    assert f"run from another directory (or take {tmp_path} out of PYTHONPATH)" in proc.stderr
