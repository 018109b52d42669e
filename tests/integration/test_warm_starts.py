"""The suite's warm starts (tests/cli_zygote.py, used by tests/conftest.py `run_cli`): a run forked from an
interpreter with torch imported behaves as `python -m largebatch` started cold: the same output, exit code,
working directory and environment; a run whose environment changes what the preloaded libraries read at import
starts cold; a run past its timeout is killed, as subprocess.run kills one."""
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from cli_zygote import IMPORT_TIME, import_time_env
from conftest import _WARM, ROOT, run_cli

DRY = ["train", "recipes/fashion_mnist.yaml", "--dry-run", "--set", "data.train_size=60000",
       "--set", "train.device_memory_gb=8"]   # no data read, no machine-dependent memory figure


def _cold(*args, cwd=None, env=None):
    os.environ["LARGEBATCH_TEST_COLD"] = "1"
    try:
        return run_cli(*args, cwd=cwd, env=env)
    finally:
        del os.environ["LARGEBATCH_TEST_COLD"]


@pytest.mark.parametrize("args", [DRY, ["train", "no_such_recipe.yaml"], ["--help"], ["no-such-command"]],
                         ids=["dry run", "user error", "help", "unknown command"])
def test_a_warm_run_prints_and_exits_as_a_cold_one(args):
    warm, cold = run_cli(*args), _cold(*args)
    assert _WARM.usable({**os.environ, "PYTHONUNBUFFERED": "1"}), "the warm-start server did not start"
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)


def test_a_warm_run_takes_its_working_directory_and_environment(tmp_path):
    shutil.copy(ROOT / "recipes" / "fashion_mnist.yaml", tmp_path / "mine.yaml")
    args = ["train", "mine.yaml", *DRY[2:]]
    proc = run_cli(*args, cwd=tmp_path, env={"WORLD_SIZE": "4"})   # a dry run plans for WORLD_SIZE workers
    assert proc.returncode == 0, proc.stderr
    assert '"world_size": 4' in proc.stdout
    assert proc.stdout == _cold(*args, cwd=tmp_path, env={"WORLD_SIZE": "4"}).stdout


def test_an_environment_that_changes_imports_starts_cold():
    here = {**os.environ, "PYTHONUNBUFFERED": "1"}
    assert _WARM.usable(here)
    for key in ("OMP_NUM_THREADS", "TORCH_CPP_LOG_LEVEL", "PYTHONPATH", "TMPDIR", "HOME"):
        assert key.startswith(IMPORT_TIME)
        assert not _WARM.usable({**here, key: here.get(key, "") + "x"}), key
    assert _WARM.usable({**here, "LARGEBATCH_FAULTS": "x"})
    assert import_time_env({"OMP_NUM_THREADS": "1", "RANK": "0"}) == {"OMP_NUM_THREADS": "1"}


def test_a_warm_run_past_its_timeout_is_killed(tmp_path):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli("train", "recipes/fashion_mnist.yaml", "--set", "data.dataset=synthetic", "--set",
                "data.synthetic_size=100000", "--run-dir", tmp_path / "run", timeout=4)
    assert time.monotonic() - start < 30
    # the killed run was reaped: the warm-start server has no child left (a forked run's /proc cmdline is the
    # server's, so its children are found by their parent)
    assert _WARM.server is not None
    children = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = (Path("/proc") / pid / "stat").read_text()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == _WARM.server.pid:
            children.append(pid)
    assert not children


def test_a_study_cell_forked_warm_prints_and_exits_as_a_cold_one(tmp_path, monkeypatch):
    """A study's cells fork from its forkserver (cells.start_cell); where that cannot be (a TMPDIR too long for
    its socket) a cell is a fresh interpreter. Both append the same output to the cell's log and exit with the
    program's code."""
    from largebatch.commands.study import cells

    monkeypatch.chdir(ROOT)
    logs, codes = {}, {}
    long_tmp = tmp_path / ("t" * 70)
    long_tmp.mkdir()
    try:
        for kind in ("warm", "cold"):
            monkeypatch.setattr("tempfile.tempdir", str(long_tmp) if kind == "cold" else None)
            for args, name in ((DRY, "dry"), (["train", "no_such_recipe.yaml"], "error")):
                log = tmp_path / f"{kind}-{name}.log"
                log.write_text("before\n")   # appended to, as a resumed cell's train.log
                proc = cells.start_cell(args, log, new_session=True)
                assert isinstance(proc, subprocess.Popen) == (kind == "cold")
                codes[kind, name] = proc.wait()
                assert proc.returncode == codes[kind, name]
                logs[kind, name] = log.read_text()
    finally:
        cells.stop_cells()
    for name in ("dry", "error"):
        assert codes["warm", name] == codes["cold", name] == (0 if name == "dry" else 2)
        assert logs["warm", name] == logs["cold", name] and logs["warm", name].startswith("before\n")
    assert '"recipe": "' in logs["warm", "dry"] and "no_such_recipe.yaml" in logs["warm", "error"]
