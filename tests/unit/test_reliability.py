"""Reliability pieces in one process: fault specs, preflight verdicts, the store watchdog's naming,
checkpoints that survive corruption and SIGKILL during writes, non-finite skipping and abort.

The multi-process, end-to-end fault tests are in test_faults.py.
"""
import datetime
import hashlib
import io
import json
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from largebatch import checkpoint, config, reliability
from largebatch.errors import UserError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_parse_faults_and_attempts(monkeypatch):
    faults = reliability.parse_faults("nan@1:3, hang@0:2-4/1 ,kill@1:7/*")
    assert faults == [reliability.Fault("nan", 1, 3, 3, 0), reliability.Fault("hang", 0, 2, 4, 1),
                      reliability.Fault("kill", 1, 7, 7, None)]
    for bad in ("nan@x:3", "boom@0:1", "nan@1"):
        with pytest.raises(UserError, match="LARGEBATCH_FAULTS"):
            reliability.parse_faults(bad)
    monkeypatch.setenv("LARGEBATCH_FAULTS", "nan@1:3-4,nan@0:9,kill@1:7/1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    inj = reliability.FaultInjector(rank=1)
    assert [inj.poison(s) for s in range(2, 6)] == [False, True, True, False]
    assert not inj.poison(9)                       # rank 0's fault
    inj.before_step(7)                             # the kill is for attempt 1 only: still alive


def _report(**kw):
    rep = {"host": "a", "config hash": "h", "code version": "v", "torch version": "t", "world size": 3,
           "local world size": 3, "train images": 100, "test images": 10, "local rank": 0, "node rank": 0}
    rep.update(kw)
    return rep


def test_preflight_names_the_odd_rank():
    ok = [_report(**{"local rank": r}) for r in range(3)]
    reliability.check_reports(ok)
    bad = [dict(r) for r in ok]
    bad[2]["config hash"] = "other"
    with pytest.raises(UserError, match=r"rank 2 on a has config hash other but rank 0 has h"):
        reliability.check_reports(bad)
    bad = [dict(r) for r in ok]
    bad[1]["train images"] = 0
    with pytest.raises(UserError, match="rank 1 on a has no training images"):
        reliability.check_reports(bad)
    bad = [dict(r) for r in ok]
    bad[1]["code version"] = "0.1.0+other"
    with pytest.raises(UserError, match="rank 1 .* code version"):
        reliability.check_reports(bad)
    bad = [dict(r) for r in ok]
    bad[2]["local rank"] = 1
    with pytest.raises(UserError, match="ranks 1 and 2 both claim local rank 1"):
        reliability.check_reports(bad)


def test_watchdog_names_missing_ranks_from_a_real_store(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"test-{os.getpid()}")
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    clients = [dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10),
                             wait_for_workers=False) for _ in range(3)]
    dogs = [reliability.Watchdog(c, r, 3, timeout_s=5, publish_every_s=0.05) for r, c in enumerate(clients)]
    for step in range(4):
        dogs[0].check_in(step, "training step")
        dogs[2].check_in(step, "training step")
        if step < 2:
            dogs[1].check_in(step, "training step")     # rank 1 stops arriving after step 1
    time.sleep(0.5)                                     # the publisher threads send the latest records
    assert dogs[0].missing() == [(1, 1, "training step")]
    with pytest.raises(reliability.CollectiveTimeout,
                       match=r"'checkpoint' at step 4 .*ranks that did not arrive: rank 1 \(last seen at step 1"):
        with dogs[0].guard(4, "checkpoint"):
            raise RuntimeError("[gloo] Timed out waiting 5000ms for recv operation to complete")
    with pytest.raises(ZeroDivisionError):       # a bug is not dressed up as a communication failure
        with dogs[0].guard(5, "step"):
            raise ZeroDivisionError()
    for dog in dogs:
        dog.close()
    del server


def test_watchdog_check_ins_do_not_touch_the_store_each_step(monkeypatch):
    """Steps only record locally; the thread sends the latest record at most once per interval, and a
    rank whose main thread is stuck (here: sleeping) still has its last record published."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"test-{os.getpid()}-pub")
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    reader = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    dog = reliability.Watchdog(reader, 0, 1, timeout_s=60, publish_every_s=1.0)
    assert dog.publish_every_s == 1.0
    key = dog._key(0)
    assert reader.get(key) == b"0|0|start"             # written at construction, before any collective
    t0 = time.perf_counter()
    for step in range(1000):
        dog.check_in(step, "training step")
    assert time.perf_counter() - t0 < 1.0              # 1,000 check-ins within one interval ...
    assert reader.get(key) == b"0|0|start"             # ... and none of them reached the store yet
    time.sleep(2.0)                                    # the main thread is "stuck"; the thread publishes
    assert reader.get(key) == b"1000|999|training step"
    assert reliability.Watchdog(None, 0, 4096, timeout_s=600).publish_every_s == pytest.approx(4.096)
    assert reliability.Watchdog(None, 0, 2, timeout_s=2).publish_every_s == 0.5   # a quarter of the timeout
    dog.close()
    del server


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(512, 1024, generator=g), "step": step}


def test_corrupt_and_truncated_checkpoints_are_named_and_skipped(tmp_path):
    for step in (1, 2, 3, 4):
        checkpoint.save(_state(step), tmp_path, step, keep=3)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == [f"step-0000000{s}.pt" for s in (2, 3, 4)]
    newest, middle = tmp_path / "step-00000004.pt", tmp_path / "step-00000003.pt"
    newest.write_bytes(newest.read_bytes()[:1000])                      # truncated
    data = bytearray(middle.read_bytes())
    data[len(data) // 2] ^= 0xFF                                       # one flipped byte, same size
    middle.write_bytes(bytes(data))
    warnings = []
    path, meta = checkpoint.latest(tmp_path, warn=warnings.append)
    assert path.name == "step-00000002.pt" and meta["step"] == 2
    assert len(warnings) == 2 and "step-00000004.pt" in warnings[0] and "step-00000003.pt" in warnings[1]
    assert torch.equal(checkpoint.load(path)["w"], _state(2)["w"])


def test_a_checkpoint_is_written_only_when_sound_and_an_unsound_one_of_an_older_writer_is_skipped(tmp_path):
    """A state with an infinity or a NaN anywhere (weights, optimizer state) is not written; what is written says
    `finite`; a checkpoint without that key (an older writer) whose weights are not finite is named and skipped
    for the sound one before it; a directory of damaged checkpoints alone has no latest, but `written` lists them."""
    assert checkpoint.save(_state(1), tmp_path, 1) is not None
    bad = _state(2)
    bad["optimizer"] = {"state": {0: {"momentum_buffer": torch.tensor([1.0, float("inf")])}}}
    assert checkpoint.non_finite(bad) == "optimizer.state.0.momentum_buffer"
    assert checkpoint.save(bad, tmp_path, 2) is None and not (tmp_path / "step-00000002.pt").exists()
    assert json.loads((tmp_path / "step-00000001.json").read_text())["finite"] is True
    legacy = _state(3)
    legacy["w"][7, 7] = float("nan")
    path = tmp_path / "step-00000003.pt"   # as a writer before this check wrote it: no "finite" in its metadata
    buf = io.BytesIO()
    torch.save(legacy, buf)
    path.write_bytes(buf.getvalue())
    (tmp_path / "step-00000003.json").write_text(json.dumps({
        "step": 3, "file": path.name, "size": len(buf.getvalue()),
        "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}))
    warnings: list[str] = []
    found = checkpoint.latest(tmp_path, warn=warnings.append)
    assert found is not None and found[0].name == "step-00000001.pt"
    assert len(warnings) == 1 and "step-00000003.pt holds non-finite values (w" in warnings[0]
    (tmp_path / "step-00000001.pt").write_bytes(b"damaged")
    assert checkpoint.latest(tmp_path, warn=warnings.append) is None
    assert [p.name for p in checkpoint.written(tmp_path)] == ["step-00000003.pt", "step-00000001.pt"]


def _writer(directory: str, start: int) -> None:
    step = start
    while True:
        checkpoint.save(_state(step % 7), __import__("pathlib").Path(directory), step, keep=2)
        step += 1




def _tiny(tmp_path, *sets):
    return config.load("fashion_mnist", [
        "model.width=4", "data.dataset=synthetic", "data.synthetic_size=128", "data.image_size=16",
        "batch.global_batch=32", "train.log_every=1", "train.plots=false", "train.max_steps=4", *sets])


@pytest.mark.timeout(120)
def test_nonfinite_steps_are_skipped_counted_then_abort(tmp_path, monkeypatch):
    from largebatch.trainer import Trainer

    torch.set_num_threads(1)
    monkeypatch.setenv("LARGEBATCH_FAULTS", "nan@0:1-2")
    trainer = Trainer(_tiny(tmp_path), tmp_path / "skip", quiet=True)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    summary = trainer.fit()
    assert summary["nonfinite_steps"] == 2 and summary["steps"] == 4 and summary["status"] == "finished"
    after = trainer.model.state_dict()
    assert all(torch.isfinite(v.float()).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)   # the finite steps did update

    monkeypatch.setenv("LARGEBATCH_FAULTS", "nan@0:0-99")
    trainer = Trainer(_tiny(tmp_path, "train.max_nonfinite=2"), tmp_path / "abort", quiet=True)
    with pytest.raises(UserError, match="3 consecutive steps with non-finite loss"):
        trainer.fit()
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items()
               if "num_batches" not in k and "running" not in k)   # no step was applied


@pytest.mark.timeout(120)
def test_a_diverging_run_writes_no_unsound_checkpoint_names_the_sound_one_and_a_damaged_only_one_refuses_resume(
        tmp_path, monkeypatch, capsys):
    """Weights that are not finite are never checkpointed (the line names the newest sound checkpoint); the
    diverged sentence names it too; a resume whose every checkpoint is damaged refuses in one sentence instead of
    training the run again from step 0 and appending a second history to its metrics."""
    from largebatch.trainer import Trainer

    torch.set_num_threads(1)
    run = tmp_path / "run"
    trainer = Trainer(_tiny(tmp_path, "train.max_steps=2", "train.checkpoint_every=1"), run, quiet=True)
    trainer.fit()
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("inf"))
    assert trainer.state.save(3, 0.5, 1.0) is None and not (run / "checkpoints" / "step-00000003.pt").exists()
    said = capsys.readouterr().err
    assert "no checkpoint written at step 3:" in said and "is not finite" in said and "step-00000002.pt" in said

    monkeypatch.setenv("LARGEBATCH_FAULTS", "nan@0:2-99")
    with pytest.raises(UserError, match=r"consecutive steps with non-finite loss.*\(the newest sound checkpoint is "
                                        r".*step-00000003\.pt, step 3\)\.$"):   # skipped steps: weights finite
        Trainer(_tiny(tmp_path, "train.max_nonfinite=1", "train.checkpoint_every=1"), tmp_path / "div",
                quiet=True).fit()
    assert json.loads((tmp_path / "div" / "summary.json").read_text())["status"] == "diverged"
    monkeypatch.delenv("LARGEBATCH_FAULTS")

    for pt in (run / "checkpoints").glob("step-*.pt"):
        pt.write_bytes(pt.read_bytes()[:100])   # every checkpoint damaged
    metrics = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(UserError, match=r"--resume found 2 checkpoint\(s\) in .* but none is intact and sound"):
        Trainer(_tiny(tmp_path, "train.max_steps=4", "train.checkpoint_every=1"), run, resume=True, quiet=True)
    assert (run / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.timeout(120)
def test_a_stop_asked_during_an_epochs_last_step_checkpoints_before_the_evaluation(tmp_path, monkeypatch):
    """A stop asked while an epoch's last step runs: the checkpoint of that step is written at once and the
    epoch's evaluation is not started (under torchrun the agent SIGKILLs 30 s after it forwards the signal, and an
    ImageNet evaluation takes longer). Every signal the agent forwards is a stop."""
    import signal

    from largebatch.trainer import Trainer

    assert set(reliability.STOP_SIGNALS) == {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}
    torch.set_num_threads(1)
    trainer = Trainer(_tiny(tmp_path, "train.max_steps=8", "data.synthetic_size=64"), tmp_path / "run", quiet=True)
    one_step = trainer._one_step

    def step_then_signal(*args):
        stop_now = one_step(*args)
        if trainer.step == 2:   # the first epoch's last step (64 images, batch 32)
            trainer.stop.signum = signal.SIGHUP   # what the handler sets
        return stop_now

    monkeypatch.setattr(trainer, "_one_step", step_then_signal)
    evaluated: list[int] = []
    monkeypatch.setattr(trainer, "_log_eval", lambda: evaluated.append(trainer.step))
    summary = trainer.fit()
    assert summary == {"stopped": True, "step": 2, "signal": signal.SIGHUP} and evaluated == []
    assert [p.name for p in checkpoint.written(tmp_path / "run" / "checkpoints")] == ["step-00000002.pt"]


@pytest.mark.timeout(120)
def test_a_run_whose_directory_is_removed_under_it_stops_in_one_sentence_and_recreates_nothing(tmp_path, monkeypatch):
    """`rm -r RUN` while it trains: the next checkpoint finds the directory gone and the run stops with one
    sentence (before, the checkpoint made a new RUN/checkpoints/ and the run ended with exit 0 and half a run)."""
    import shutil

    from largebatch.trainer import Trainer

    torch.set_num_threads(1)
    run = tmp_path / "run"
    trainer = Trainer(_tiny(tmp_path, "train.max_steps=6", "train.checkpoint_every=2"), run, quiet=True)
    one_step = trainer._one_step

    def step_then_remove(*args):
        stop_now = one_step(*args)
        if trainer.step == 3:
            shutil.rmtree(run)
        return stop_now

    monkeypatch.setattr(trainer, "_one_step", step_then_remove)
    with pytest.raises(UserError, match=rf"the run directory {run} was removed or replaced while the run was writing "
                                        r"to it \(at step 4\)"):
        trainer.fit()
    assert not run.exists()


@pytest.mark.timeout(120)
def test_resuming_a_finished_run_changes_nothing_and_says_so(tmp_path, capsys):
    """--resume of a run that finished: its summary as it was (no second evaluation, no second session's time in
    the time to train), metrics.jsonl untouched, one line saying how to train on."""
    from largebatch.trainer import Trainer

    torch.set_num_threads(1)
    run = tmp_path / "run"
    first = Trainer(_tiny(tmp_path, "train.max_steps=2"), run, quiet=True).fit()
    files = {p: p.read_bytes() for p in (run / "summary.json", run / "metrics.jsonl")}
    capsys.readouterr()
    again = Trainer(_tiny(tmp_path, "train.max_steps=2"), run, resume=True, quiet=True).fit()
    assert again == json.loads(json.dumps(first)) and all(p.read_bytes() == b for p, b in files.items())
    assert "finished at step 2 (summary.json); nothing is left to train" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_more_epochs_on_resume_stretch_the_decay_from_the_resumed_step_and_say_so(tmp_path, capsys):
    """docs/reliability.md: more epochs on resume stretch the decay from the resumed step. A cosine run of 4
    epochs stopped at epoch 2, resumed with 8: the lr at the resumed step is the one it had (it jumped by half
    before), the resume line says what the lr does, and a later resume with no change keeps the stretch (it is in
    the checkpoint)."""
    from largebatch.trainer import Trainer

    torch.set_num_threads(1)
    base = ["data.synthetic_size=64", "schedule.decay=cosine", "schedule.warmup_epochs=0", "train.checkpoint_every=1"]
    run = tmp_path / "run"
    first = Trainer(_tiny(tmp_path, *base, "schedule.epochs=4", "train.max_steps=4"), run, quiet=True)
    lr_at_4 = first.plan.lr(4)
    first.fit()
    capsys.readouterr()
    longer = _tiny(tmp_path, *base, "schedule.epochs=8", "train.max_steps=6")
    resumed = Trainer(longer, run, resume=True, quiet=True)
    assert resumed.step == 4 and resumed.plan.lr(4) == pytest.approx(lr_at_4)
    from largebatch.schedule import Plan
    jumped = Plan(longer.batch, longer.optim, longer.schedule, world_size=1, train_size=64).lr(4)
    assert jumped > 1.4 * lr_at_4   # what the run did before: the 8-epoch schedule's lr at epoch 2
    said = capsys.readouterr().err
    assert "the decay is stretched from epoch 2 to end at epoch 8 instead of 4: the lr goes on from" in said
    lr_at_6 = resumed.plan.lr(6)
    resumed.fit()
    again = Trainer(_tiny(tmp_path, *base, "schedule.epochs=8", "train.max_steps=8"), run, resume=True, quiet=True)
    try:
        assert again.step == 6 and again.plan.lr(6) == pytest.approx(lr_at_6) and again.plan.lr(15) < 0.02 * lr_at_4
    finally:
        again.close()


@pytest.mark.timeout(120)
def test_every_collective_of_the_loop_runs_inside_a_watchdog_region(tmp_path, monkeypatch):
    """The collectives outside the training step (the logging step's loss all-reduce, an ensemble snapshot's BN
    sync and barrier, the epoch-end stop check, evaluation, checkpoints) run inside a region of the watchdog, so
    a peer lost there is named in one sentence as in the step, not a bare traceback per node."""
    import contextlib

    from largebatch.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(_tiny(tmp_path, "train.max_steps=6", "data.synthetic_size=64", "schedule.epochs=1",
                            "ensemble.cycles=1", "ensemble.cycle_epochs=2", "ensemble.rewarm_epochs=0.5",
                            "ensemble.collapse_epochs=0.5"), tmp_path / "run", quiet=True)
    regions: set[str] = set()
    guard = trainer.watchdog.guard

    @contextlib.contextmanager
    def recording(step, region):
        regions.add(region)
        with guard(step, region):
            yield

    monkeypatch.setattr(trainer.watchdog, "guard", recording)
    trainer.fit()
    assert {"logging step (loss all-reduce)", "ensemble snapshot (BN sync)", "stop check (epoch end)",
            "training step (stop flag + gradient all-reduce)", "evaluation",
            "checkpoint (BN sync + barrier)"} <= regions, regions


def test_the_agents_keep_alive_timer_collected_on_its_own_thread_prints_nothing_else_does():
    """torch's rendezvous keep-alive `_PeriodicTimer` (the real class), left running by an agent that ended by a
    signal, collected on its own thread: its finalizer's join raises "cannot join current thread", which the
    agent's hook (launch._quiet_keep_alive_join) drops; any other unraisable exception reaches the hook before."""
    import sys
    import weakref
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer

    from largebatch import launch

    seen, before = [], sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        launch._quiet_keep_alive_join()
        holder: dict = {}

        def drop_the_timer_here() -> None:   # on the timer's thread: its last reference goes, its finalizer runs
            holder.pop("timer", None)

        timer = _PeriodicTimer(timedelta(seconds=0.01), drop_the_timer_here)
        timer.start()
        thread = timer._thread
        holder["timer"] = timer
        del timer
        thread.join(10)
        assert not thread.is_alive() and not holder

        class Other:
            pass

        def fails() -> None:
            raise RuntimeError("cannot join current thread")   # the same words from elsewhere: passed on

        other = Other()
        weakref.finalize(other, fails)
        del other
        assert [type(u.exc_value) for u in seen] == [RuntimeError]
        assert all("_stop_thread" not in str(u.exc_traceback.tb_frame.f_code) for u in seen)
    finally:
        sys.unraisablehook = before


def test_local_launches_rendezvous_on_a_port_their_store_binds_with_an_id_of_their_own():
    """torchrun --standalone's rendezvous for every local launch: endpoint port 0 (the agent's store binds a free
    port itself) and a run id per launch. A port picked before the agent binds it can be taken meanwhile by
    another launch on the host, whose store torch's c10d backend then joins as a client: two launches of the
    suite shared one rendezvous and one waited out the other's exit barrier (300 s)."""
    from largebatch.launch import local_workers

    def value(args: list[str], flag: str) -> str:
        return args[args.index(flag) + 1]

    a, b = local_workers(2, ["train"]), local_workers(2, ["train"])
    assert value(a, "--rdzv-endpoint") == value(b, "--rdzv-endpoint") == "127.0.0.1:0"
    assert value(a, "--rdzv-id") != value(b, "--rdzv-id") and len(value(a, "--rdzv-id")) == 32
