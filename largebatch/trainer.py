"""The training loop: synchronous data-parallel SGD with the large-batch recipe.

`Trainer.__init__` reads top to bottom in the order things are built:
device and process group -> data -> step plan -> run directory -> what a resume changes -> model ->
DDP and comm hook -> optimizer -> precision -> checkpoint restore. `fit()` runs the steps.

The loop is `while step < total: train_step(); log(); maybe_evaluate(); maybe_checkpoint()`:
`batches.BatchSource` yields each step's micro-batches (it owns the epoch, phase and collapse
boundaries), `step.TrainStep` takes the optimizer step (micro-batches, gradient accumulation,
precision, the finiteness verdict), the plan gives the step's lr (scaling rule, warm-up, decay,
batch phase). The step makes no host sync: the non-finite verdict and its counters stay on the device
and are read on logging steps, checkpoints and at the end (`TrainStep.check`).
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from largebatch import checkpoint, dist as dist_mod, ensemble, graph, memory, metrics as metrics_mod, reliability, rundir, runplan, evaluation
from largebatch.batches import BatchSource
from largebatch.config import Config
from largebatch.config import save as save_config
from largebatch.data.info import check_classes
from largebatch.errors import UserError
from largebatch.placement import prefetch, use_channels_last
from largebatch.models.classifier import build_classifier
from largebatch.noise_scale import NoiseScale
from largebatch.progress import LogWindow, Progress
from largebatch.schedule import resolution_at
from largebatch.step import Diverged, TrainStep

if TYPE_CHECKING:
    from largebatch.comm.hook import CommHookState
    from largebatch.data import Source


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path | None = None, *, resume: bool = False, quiet: bool = False,
                 allow_change: tuple[str, ...] = ()):
        # what `close` stops, present even when building fails part-way (None only until `_build` sets it)
        self.watchdog: reliability.Watchdog | None = None
        self.comm_state: CommHookState | None = None
        self.claim: rundir.Claim | None = None
        self.train_data: Source | None = None
        self.test_data: Source | None = None
        try:
            self._build(cfg, run_dir, resume, quiet, allow_change)
        except BaseException:
            self.close()
            raise

    def _build(self, cfg: Config, run_dir: Path | None, resume: bool, quiet: bool, allow_change: tuple[str, ...]) -> None:
        from largebatch.data import build_data
        from largebatch.optim import build_ema, build_optimizer

        self.cfg, self.quiet = cfg, quiet
        t = cfg.train
        # 1. device, process group, threads
        self.device = dist_mod.pick_device(t.device)
        if t.precision == "fp16" and self.device.type != "cuda":
            # bf16, not fp32: the CPU's half type (autocast, channels-last kernels), with fp32's exponent range, so
            # it needs no loss scale (the GradScaler is CUDA's). Set in the config: GradScaler, step, evaluation,
            # config.yaml and summary.json then all say what ran (train.precision is resumable, so a later resume
            # on CUDA with fp16 is accepted and recorded).
            t.precision = "bf16"
            if dist_mod.env_info().is_main:
                print(f"largebatch: train.precision fp16 needs CUDA; training in bf16 on {self.device.type.upper()} "
                      "(set train.precision=bf16 to silence this).", file=sys.stderr, flush=True)
        self.info = dist_mod.init(self.device, cfg.comm.timeout_s)
        use_graph, why_not = graph.plan(t.cuda_graph, self.device, self.info.world_size, t.noise_scale,
                                        t.compile_mode if t.compile else None)
        self.threads = dist_mod.set_threads(t.threads, self.info.local_world_size)
        self.main = self.info.is_main
        if t.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        dist_mod.configure_backends(self.device, t.deterministic)
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        # reliability (largebatch/reliability.py): control store, watchdog, stop agreement, fault knob
        self.store = reliability.control_store(self.info.world_size, cfg.comm.timeout_s)
        self.watchdog = reliability.Watchdog(self.store, self.info.rank, self.info.world_size, cfg.comm.timeout_s)
        self.stop = reliability.StopAgreement(self.info.distributed, self.device)
        self.faults = reliability.FaultInjector(self.info.rank)

        # 2. data, before the run directory: missing or damaged data leaves no directory behind (every rank
        # builds its own; preflight compares them)
        self.train_data, self.test_data, self.data_info = build_data(cfg.data, t.seed)
        reliability.preflight(self.info, config_hash=cfg.hash(), train_size=len(self.train_data),
                              test_size=len(self.test_data))

        # 3. the run plan (largebatch/runplan.py): the memory the device has and the run needs, the micro-batch that
        # fits it (batch.micro_batch auto), the phases with their accumulation, steps and lr per step; before
        # anything is written: a model whose state does not fit, or a batch that does not split, is one sentence
        # and leaves no directory behind
        run_plan = runplan.decide(cfg, self.data_info, world_size=self.info.world_size,
                                  local_workers=self.info.local_world_size, train_size=len(self.train_data),
                                  device_type=self.device.type, device=self.device)
        self.plan, self.memory = run_plan.schedule, run_plan.estimate
        said = run_plan.auto_split()
        if said and self.main:   # auto split a batch: say how
            print(f"largebatch: {said}", file=sys.stderr, flush=True)
        self.total_steps = min(self.plan.total_steps, t.max_steps or self.plan.total_steps)
        self.batches = BatchSource(self.plan, self.train_data, self.info.rank, self.info.world_size, t.seed)

        # 4. run directory (rank 0 decides and locks it, everyone agrees; largebatch/rundir.py)
        self.run_dir, self.claim = rundir.agree(run_dir, resume, main=self.main, distributed=self.info.distributed,
                                                default_name=Path(cfg.recipe).stem, store=self.store)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.run_dir_id = _identity(self.run_dir)   # `_check_run_dir`: the directory the run took, not another later

        # 5. what a resume changes: refused before anything is built or written, or accepted (recorded below)
        found = checkpoint.latest(self.ckpt_dir, warn=self._say) if resume else None
        damaged = checkpoint.written(self.ckpt_dir) if resume and found is None else []
        if damaged:   # a resume from step 0 would train the run again and append a second history to its metrics
            raise UserError(f"--resume found {len(damaged)} checkpoint(s) in {self.ckpt_dir} but none is intact and "
                            "sound (each named above); restore one from a copy, or start the run afresh with a new "
                            "--run-dir.")
        self.resume_changes = self._resume_changes(cfg, found, allow_change) if resume else []

        # 6. model
        torch.manual_seed(t.seed)   # identical initial weights on every rank and every world size
        self.model = model = build_classifier(cfg.model, self.data_info, self.device,
                                              use_channels_last(t.channels_last, self.device, t.precision),
                                              [p.image_size for p in cfg.data.resolution_phases])
        self.channels_last = model.channels_last   # batches follow the model's memory format
        if model.channels_last_note and self.main:
            print(f"largebatch: {model.channels_last_note}", file=sys.stderr, flush=True)
        for note in model.notes if self.main else []:   # e.g. a model from elsewhere without residual zero-init
            print(f"largebatch: {note}", file=sys.stderr, flush=True)
        self.ema = build_ema(model, t.ema)

        # 7. data parallelism and the communication hook
        self.ddp: torch.nn.Module = model
        if self.info.distributed:
            self.ddp = dist_mod.wrap_ddp(model, self.device, cfg.comm.bucket_mb)
            from largebatch.comm import install

            self.comm_state = install(self.ddp, cfg.comm)   # None: DDP's own all-reduce, no hook
        mode = None if t.compile_mode == "default" else t.compile_mode
        forward = torch.compile(self.ddp, mode=mode) if t.compile else self.ddp

        # 8. optimizer (lr set per step from the plan)
        self.optimizer = build_optimizer(cfg.optim, model, lr=self.plan.lr(0))
        # Collapsed Ensemble: weight decay x factor in collapses (from these base values), snapshot steps.
        self.base_weight_decay = [g["weight_decay"] for g in self.optimizer.param_groups]
        self.snapshot_steps = set(self.plan.snapshot_steps())

        # 9. precision, the gradient noise scale (on logging steps), the step itself and its CUDA graph
        self.scaler = torch.amp.GradScaler("cuda", enabled=t.precision == "fp16")
        self.noise = NoiseScale.for_run(self.info.distributed, self.main) if t.noise_scale else None
        self.progress = Progress()
        self.train_step = TrainStep(
            model=model, ddp=self.ddp, forward=forward, optimizer=self.optimizer, scaler=self.scaler, ema=self.ema,
            noise=self.noise, faults=self.faults, device=self.device, world_size=self.info.world_size,
            precision=t.precision, channels_last=self.channels_last, label_smoothing=t.label_smoothing,
            log_every=t.log_every, max_nonfinite=t.max_nonfinite, progress=self.progress)
        if use_graph:
            self.train_step.graph = graph.GraphedStep(self.train_step)
        elif why_not and self.main:
            print(f"largebatch: training without a CUDA graph: {why_not}.", file=sys.stderr, flush=True)

        # 10. state that checkpoints carry, restored on a resume
        self.state = checkpoint.RunState(
            self.ckpt_dir, model=model, optimizer=self.optimizer, scaler=self.scaler, ema=self.ema, noise=self.noise,
            comm_state=self.comm_state, progress=self.progress, config_hash=cfg.hash(), optimizer_name=cfg.optim.name,
            keep=t.keep_checkpoints, main=self.main,
            meta={"config": cfg.to_dict(), "world_size": self.info.world_size,   # what a resume compares with
                  "model": model.built})   # which model was built (models/external.py: Built)
        resumed = self.state.resume(found) if resume else None
        self.step = resumed or 0
        self.stretch_note = self._stretch_decay(found) if resumed is not None else ""
        self.session_start = self.step   # the first step of this session (out-of-memory retries: memory.py 6)
        self.saved_step = resumed   # the newest checkpoint's step: a stop right after a resume does not rewrite it
        self.last_eval: dict | None = None
        self.t_start: float | None = None
        self.metrics = metrics_mod.MetricsLog(self.run_dir / "metrics.jsonl", enabled=self.main)
        self.display = metrics_mod.ProgressDisplay(self.total_steps, self.step, enabled=self.main and not quiet)
        # config.yaml is the run's settings (`evaluate` reads them): written at the start and on an accepted change
        if self.main and (self.resume_changes or not (self.run_dir / "config.yaml").exists()):
            save_config(cfg, self.run_dir / "config.yaml")
        if self.resume_changes:
            self._record_resume(found)
        if self.main:   # labels by class name: written at the start, compared on a resume (and by evaluate)
            check_classes(self.run_dir, self.data_info.classes, write=True)

    # ------------------------------------------------------------------ what a resume changes
    def _say(self, line: str) -> None:
        if self.main:
            print(line, file=sys.stderr, flush=True)

    def _resume_changes(self, cfg: Config, found: tuple[Path, dict] | None,
                        allow_change: tuple[str, ...]) -> list[tuple[str, object, object]]:
        """The settings (and the world size) that differ from those the newest checkpoint was written with (its
        metadata's config; config.yaml for a checkpoint of an older version; config.yaml when there is no
        checkpoint, and then nothing was trained with them and every change is accepted). Refused in one
        sentence (`resume.check_resume`): a change of what the run is that `allow_change` does not name, and any
        change that would make the epoch count jump (the checkpoint's epoch against this plan's at its step)."""
        from largebatch import config as config_mod, resume

        meta = found[1] if found is not None else {}
        old = meta.get("config")
        if not isinstance(old, dict):
            path = self.run_dir / "config.yaml"
            old = config_mod.load_yaml(path, what="run config") if path.is_file() else {}
        changes = resume.resume_changes(old, cfg)
        if found is None:
            return changes
        resume.check_resume(changes, list(allow_change), self.run_dir)
        step, epoch = meta.get("step"), meta.get("epoch")
        if isinstance(step, int) and isinstance(epoch, (int, float)) and abs(self.plan.epoch_float(step) - epoch) > 1e-6:
            phase = self.plan.phase_at(step)
            raise UserError(f"checkpoint {found[0]} was written at step {step}, epoch {epoch:.6g}, but with these "
                            f"settings ({self.plan.train_size} training images, global batch {phase.global_batch}) step "
                            f"{step} is epoch {self.plan.epoch_float(step):.6g}, so the epoch count would jump; resume "
                            "with the data and batch settings the run was trained with (its config.yaml), or start a "
                            "new run with a fresh --run-dir.")
        world = meta.get("world_size")
        if isinstance(world, int) and world != self.info.world_size:   # legitimate (same global batch); recorded
            changes.append(("world size", world, self.info.world_size))
        return changes

    def _record_resume(self, found: tuple[Path, dict] | None) -> None:
        """An accepted change: config.yaml was rewritten (above); a "resume" entry in metrics.jsonl and one line."""
        from largebatch.config import shown

        changes = {key: [old, new] for key, old, new in self.resume_changes}
        self.metrics.write({"kind": "resume", "step": self.step, "epoch": round(self.plan.epoch_float(self.step), 4),
                            "checkpoint": found[0].name if found else None, "changes": changes})
        listed = ", ".join(f"{key} {shown(old)} -> {shown(new)}" for key, (old, new) in changes.items())
        self._say(f"largebatch: resuming at step {self.step} with changed settings: {listed} (recorded in "
                  f"{self.run_dir / 'config.yaml'} and as a resume entry in metrics.jsonl){self.stretch_note}.")

    def _stretch_decay(self, found: tuple[Path, dict] | None) -> str:
        """The decay's stretches (schedule.Plan.stretches): those the checkpoint carries, and one more where this
        resume changed the decay's length (schedule.epochs, or schedule.decay_epochs; a cosine or poly decay: a step
        decay's milestones are epochs of their own, its lr does not depend on the length): the lr goes on from its value
        at the resumed step and reaches the schedule's end at the new length, instead of jumping to where a run of
        the new length would be (docs/reliability.md, What a resume may change). What it does, as a clause for the
        resume line ("" when nothing was stretched)."""
        stretches = list(self.progress.lr_stretches or [])
        old_cfg = (found[1].get("config") or {}) if found else {}
        old_schedule = old_cfg.get("schedule") if isinstance(old_cfg, dict) else None
        note = ""
        if isinstance(old_schedule, dict) and not self.plan.segments and self.cfg.schedule.decay in ("cosine", "poly"):
            before = float(old_schedule.get("decay_epochs") or old_schedule.get("epochs") or self.plan.horizon)
            after, at = self.plan.horizon, self.plan.epoch_float(self.step)
            stretched = before != after and at < min(before, after)
            if stretched:
                stretches.append((at, before, after))
            self.plan.stretches = [tuple(x) for x in stretches]
            lr_now = self.plan.lr(self.step)   # continuous with the checkpoint's schedule where stretched
            if stretched:
                note = (f"; the decay is stretched from epoch {at:.4g} to end at epoch {after:g} instead of "
                        f"{before:g}: the lr goes on from {lr_now:.4g}")
            elif before != after:   # at or past the end of the decay it was on: there is nothing left to stretch
                note = (f"; the run had reached the end of its decay (epoch {before:g}), so the lr follows the "
                        f"schedule of {after:g} epochs from here: {lr_now:.4g} at this step")
        self.progress.lr_stretches = stretches
        self.plan.stretches = [tuple(x) for x in stretches]
        return note

    # ------------------------------------------------------------------ checkpoints
    def _finished_before(self) -> dict | None:
        """A resume of a run that had already finished (its newest checkpoint at the last step, summary.json
        `finished`), with no setting changed: its summary as it is, said in one line. Evaluating again would rewrite summary.json and add
        this session's time to the time to train."""
        import json

        if self.saved_step is None or self.step < self.total_steps or self.resume_changes:
            return None   # with an accepted change (train.ema, eval_flip, ...) it evaluates with it, as asked
        try:
            summary = json.loads((self.run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return None   # stopped or killed after its last checkpoint: its outputs are written now
        if not isinstance(summary, dict) or summary.get("status") != "finished" or summary.get("steps") != self.step:
            return None
        if self.main:
            print(f"largebatch: the run in {self.run_dir} finished at step {self.step} (summary.json); nothing is left "
                  "to train and nothing was changed: give more schedule.epochs (or a larger train.max_steps) to train "
                  "on.", file=sys.stderr, flush=True)
        self.metrics.close()
        return summary

    def _check_run_dir(self) -> None:
        """The run directory is still the one the run took: removed or replaced under it, a checkpoint or the
        summary would otherwise create a new directory of that name holding half a run (and exit 0)."""
        if _identity(self.run_dir) != self.run_dir_id:
            raise UserError(f"the run directory {self.run_dir} was removed or replaced while the run was writing to "
                            f"it (at step {self.step}), so nothing more is written there; restore it and continue with "
                            "--resume, or start the run again with another --run-dir.")

    def save_checkpoint(self) -> None:
        if self.saved_step == self.step:   # already written (e.g. a stop at an epoch end)
            return
        self._check_run_dir()
        self.train_step.check()   # the skipped-step count goes into the checkpoint's progress
        with self._guard("checkpoint (BN sync + barrier)"):
            self._sync_buffers()   # every rank must hold the same BN statistics when they are written
            if self.main:
                self.state.save(self.step, self.plan.epoch_float(self.step), self._session_wall())
            if self.info.distributed:
                dist.barrier()
        self.saved_step = self.step

    # ------------------------------------------------------------------ helpers
    def _guard(self, region: str):
        """The watchdog's guard of a collective-bearing region at this step (reliability.Watchdog)."""
        assert self.watchdog is not None   # set by `_build`; None only while building
        return self.watchdog.guard(self.step, region)

    def _session_wall(self) -> float:
        return time.perf_counter() - self.t_start if self.t_start is not None else 0.0

    def _sync_buffers(self) -> None:
        """Average BN running statistics across workers (they are per worker during training)."""
        if self.info.distributed:
            evaluation.average_buffers([b for b in self.model.buffers() if b.is_floating_point()], self.info.world_size)

    # ------------------------------------------------------------------ training
    def fit(self) -> dict:
        """Train to the end (or to an agreed stop); the summary. Stops the watchdog's publisher after."""
        try:
            return self._fit()
        except Diverged as diverged:   # a result of the settings: recorded as the run's status, then said
            sound = checkpoint.latest(self.ckpt_dir, warn=lambda m: None)
            err = Diverged(str(diverged).rstrip(".") + (
                f" (the newest sound checkpoint is {sound[0]}, step {sound[1]['step']})." if sound else
                " (no sound checkpoint was written)."))
            if self.main:
                metrics_mod.write_summary(self.run_dir, metrics_mod.diverged_summary(
                    recipe=self.cfg.recipe, run_dir=self.run_dir, reason=str(err),
                    epochs=self.plan.epoch_float(self.step), steps=self.step, world_size=self.info.world_size,
                    machine=metrics_mod.machine(self.device)))
            self.metrics.close()
            raise err from None
        finally:
            self.close()

    def close(self, timeout_s: float = 30.0) -> bool:
        """The trainer's part of the ordered teardown: stop and join every thread of ours
        (`reliability.stop_threads`), stop the data loaders, release the run directory, then synchronise and
        reset the step's CUDA graphs (largebatch/graph.py step 7: now, not when the garbage collector gets to
        them, where freeing one could free a workspace another trainer's live graph uses). Idempotent; True
        when every thread ended."""
        joined = reliability.stop_threads(self.watchdog, self.comm_state, timeout_s)
        for source in (self.train_data, self.test_data):
            if source is not None and hasattr(source, "close"):
                source.close()
        if self.claim is not None:   # the run directory is free for the next writer (e.g. --resume)
            self.claim.release()
            self.claim = None
        train_step = getattr(self, "train_step", None)   # absent when building failed before it
        if train_step is not None and train_step.graph is not None:
            train_step.graph.close()
        return joined

    def _fit(self) -> dict:
        """while step < total: train_step; maybe snapshot, log, checkpoint; stop if every rank agreed; at an
        epoch end maybe evaluate, then checkpoint."""
        self.t_start = time.perf_counter()
        done = self._finished_before()
        if done is not None:
            return done
        self.stop.install()   # SIGTERM, SIGINT, SIGHUP, SIGQUIT set a flag; ranks agree on it every step (reliability.py)
        epoch_ends = set(self.plan.epoch_end_steps())
        self.window = LogWindow(self.device, self.step, self.progress.images_seen)
        stopped = False
        self.model.train()
        try:
            steps = prefetch(self.batches.steps(self.step, self.total_steps), self.device, self.channels_last)
            for phase, micros, wait in steps:   # on CUDA, the next step's batches are copied on a side stream
                t0 = time.perf_counter()
                self.window.data_wait += wait
                lr = self.plan.lr(self.step)
                stop_now = self._one_step(phase, micros, lr)
                self.progress.train_time += time.perf_counter() - t0 + wait
                if self.step in self.snapshot_steps:
                    self._save_snapshot()
                at_epoch_end = self.step in epoch_ends or self.step == self.total_steps
                if self.step % self.cfg.train.log_every == 0 or at_epoch_end:
                    self._log_train(phase, lr)
                every = self.cfg.train.checkpoint_every
                if every and self.step % every == 0 and not at_epoch_end:
                    self.save_checkpoint()
                if stop_now:   # every rank agreed on this step boundary (reliability.StopAgreement)
                    stopped = True
                    break
                if at_epoch_end:
                    with self._guard("stop check (epoch end)"):
                        asked = self.stop.asked_anywhere()
                    if asked:   # the checkpoint now, not after an evaluation the agent's grace period may not cover
                        stopped = True
                        break
                    self._end_epoch()
        finally:
            self.display.close()
            if self.comm_state is not None:
                self.comm_state.close()
        if stopped:
            self.save_checkpoint()
            if self.main:
                self.stop.announce(self.step, self.cfg.recipe, self.info.world_size, self.run_dir)
            self.metrics.close()
            return {"stopped": True, "step": self.step, "signal": self.stop.signum}
        return self._finish()

    def _one_step(self, phase, micros: list, lr: float) -> bool:
        """One optimizer step (with the Collapsed Ensemble's weight decay and the stop agreement); True when
        every rank agreed to stop after it."""
        if self.plan.segments:
            ensemble.set_weight_decay(self.optimizer, self.base_weight_decay, self.plan.weight_decay_factor(self.step))
        self.faults.before_step(self.step)   # LARGEBATCH_FAULTS debugging knob; no-op when unset
        with self._guard("training step (stop flag + gradient all-reduce)"):
            self.stop.start()                 # async flag all-reduce, overlaps the step
            size = resolution_at(self.cfg.data.resolution_phases, self.plan.epoch_float(self.step))
            while True:
                try:
                    loss = self.train_step(self.step, micros, phase, lr, size)
                    break
                except torch.OutOfMemoryError as err:
                    self._out_of_memory(err, phase)   # a smaller forward batch to retry with, or one sentence
            self.window.loss += loss
            stop_now = self.stop.agreed()
        self.progress.images_seen += phase.global_batch
        self.step += 1
        return stop_now

    def _out_of_memory(self, err: torch.OutOfMemoryError, phase) -> None:
        """largebatch/memory.py step 6: halve the forward batch and let the caller retry the step, or stop with one
        sentence naming batch.micro_batch."""
        ts = self.train_step
        current = ts.forward_cap or phase.micro_batch
        early = self.step < self.session_start + memory.OOM_RETRY_STEPS or \
            self.step < phase.start_step + memory.OOM_RETRY_STEPS
        what = (str(err).strip().splitlines() or [""])[0][:160]
        if not early or self.info.world_size > 1 or ts.graph is not None or current <= 1:
            raise UserError(f"the device ran out of memory at step {self.step} with forward batches of {current} "
                            f"images per worker ({what}); set batch.micro_batch below {current} (e.g. "
                            f"{max(current // 2, 1)}), or train.device_memory_gb to what the device can give and "
                            "batch.micro_batch to auto.") from None
        ts.forward_cap = current // 2
        ts.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._say(f"largebatch: out of memory at step {self.step} with forward batches of {current} images per "
                  f"worker; retrying the step with {ts.forward_cap} (the global batch and lr unchanged).")

    def _log_train(self, phase, lr: float) -> None:
        """A logging step: the host syncs of training (the skipped-step counters, the window's loss)."""
        self.train_step.check()
        with self._guard("logging step (loss all-reduce)"):   # a lost peer here is named as in the step
            window = self.window.close(self.step, self.progress.images_seen, self.info.world_size)
        rec = {"kind": "train", "step": self.step, "epoch": round(self.plan.epoch_float(self.step), 4),
               "loss": window.pop("loss"), "lr": lr, "global_batch": phase.global_batch, **window,
               "nonfinite_steps": self.progress.nonfinite_total,
               "time": self.progress.wall_before + self._session_wall(), **self.train_step.noise_rec}
        self.train_step.noise_rec = {}
        self.metrics.write(rec)
        self.display.update(rec)

    def _end_epoch(self) -> None:
        """Evaluate every `eval_every` epochs (and at the end), then checkpoint."""
        every = self.cfg.train.eval_every
        completed_epoch = self.plan.position(self.step - 1)[0] + 1
        if (every and completed_epoch % every == 0) or self.step == self.total_steps:
            self._log_eval()
        self.save_checkpoint()

    # ------------------------------------------------------------------ evaluation
    def _log_eval(self) -> dict:
        """Evaluate the model (the EMA model when there is one) on the test (or validation) set; log it."""
        model = self.ema.module if self.ema is not None else self.model
        with self._guard("evaluation"):
            self._sync_buffers()
            result = evaluation.evaluate(model, self.test_data, self.info, self.device, precision=self.cfg.train.precision,
                                      channels_last=self.channels_last, flip=self.cfg.train.eval_flip,
                                      batch=max(256, self.plan.phase_at(max(self.step - 1, 0)).micro_batch))
        self.progress.best_top1 = max(self.progress.best_top1, result["top1"])
        self.metrics.write({"kind": "eval", "step": self.step, "epoch": round(self.plan.epoch_float(self.step), 4),
                            **result, "time": self.progress.wall_before + self._session_wall()})
        if self.main and not self.quiet:
            self.display.message(f"eval step {self.step}: top-1 {result['top1']:.4f}  top-5 {result['top5']:.4f}  "
                                 f"loss {result['loss']:.4f}")
        self.last_eval = result
        return result

    def _save_snapshot(self) -> None:
        """Collapsed Ensemble: keep the collapsed weights (BN statistics averaged over ranks first)."""
        with self._guard("ensemble snapshot (BN sync)"):
            self._sync_buffers()
        if self.main and ensemble.save_snapshot(self.model, self.run_dir, self.step,
                                                self.plan.epoch_float(self.step)) is None:
            print(f"largebatch: no ensemble snapshot written at step {self.step}: "
                  f"{checkpoint.non_finite(self.model.state_dict())} is not finite (the run is diverging).",
                  file=sys.stderr, flush=True)
        if self.info.distributed:
            with self._guard("ensemble snapshot (barrier)"):
                dist.barrier()

    def _ensemble_eval(self) -> dict:
        """Every snapshot, their softmax-average ensemble (and SWA): a metrics record and summary keys."""
        rec, count = ensemble.evaluate_run(
            self.model, self.run_dir, self.train_data, self.test_data, self.info, self.device,
            batch=max(256, self.plan.phases[-1].micro_batch), bn_batch=self.plan.phases[-1].micro_batch,
            seed=self.cfg.train.seed,
            precision=self.cfg.train.precision, channels_last=self.channels_last, swa=self.cfg.ensemble.swa,
            flip=self.cfg.train.eval_flip)
        self.metrics.write({"kind": "ensemble", "step": self.step, **rec})
        if self.main and not self.quiet:
            self.display.message(f"ensemble of {count} snapshots: top-1 {rec['ensemble_top1']:.4f} "
                                 f"(best snapshot {rec['best_snapshot_top1']:.4f})")
        return rec

    def _finish(self) -> dict:
        self.train_step.check()
        last = self.last_eval or self._log_eval()
        # Collapsed Ensemble: only once a snapshot exists (a run stopped early by max_steps may have none).
        has_snapshot = any(s <= self.step for s in self.plan.snapshot_steps())
        ensemble_rec = self._ensemble_eval() if has_snapshot else {}
        wall = self.progress.wall_before + self._session_wall()
        corrupt = list(getattr(self.train_data, "corrupt", [])) + list(getattr(self.test_data, "corrupt", []))
        # every rank skipped its own share of the corrupt files; a file is met once per epoch and evaluation
        with self._guard("gather corrupt-image lists"):
            corrupt = dist_mod.gather_union(corrupt, self.info.world_size)
        summary = metrics_mod.run_summary(
            recipe=self.cfg.recipe, run_dir=self.run_dir, last_eval=last, progress=self.progress, wall_s=wall,
            epochs=self.plan.epoch_float(self.step), steps=self.step, world_size=self.info.world_size,
            global_batch=self.plan.phase_at(self.step - 1).global_batch, corrupt_images=len(corrupt),
            precision=self.cfg.train.precision, threads=self.threads, ensemble=ensemble_rec,
            machine=metrics_mod.machine(self.device))
        summary.update(train_images=self.data_info.train_size, val_images=self.data_info.test_size)   # what was read
        finishers = [getattr(s, "finisher", None) for s in (self.train_data, self.test_data)]
        if any(f is not None for f in finishers):   # GPU decoding: valid JPEGs its decoder refused (rank 0's count)
            summary["gpu_decode_cpu_fallbacks"] = sum(getattr(f, "cpu_fallbacks", 0) for f in finishers)
        self._check_run_dir()
        if self.main:
            metrics_mod.write_outputs(self.run_dir, summary, corrupt, plots=self.cfg.train.plots,
                                      tensorboard=self.cfg.train.tensorboard)
        self.metrics.close()
        return summary


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the directory at `path`; None when there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino)
