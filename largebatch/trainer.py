"""The training loop: synchronous data-parallel SGD with the large-batch recipe.

`Trainer.__init__` reads top to bottom in the order things are built:
device and process group -> run directory -> data -> step plan -> model -> DDP and comm
hook -> optimizer -> precision -> checkpoint restore. `fit()` runs the steps.

Per step (Goyal et al.): every worker takes its contiguous slice of the step's global batch
from one shuffle per epoch, runs `accumulation` micro-batches (DDP's `no_sync()` on all but
the last), each micro-batch's loss summed over its images and divided by the per-worker batch,
so that DDP's average over workers normalises the gradient by the global batch. The lr of
the step comes from the plan (scaling rule, warm-up, decay, batch phase). Host syncs happen
once per step for the non-finite check (one scalar) and on logging steps only otherwise.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from largebatch import checkpoint, dist as dist_mod, ensemble, metrics as metrics_mod, reliability, rundir, scoring
from largebatch.config import Config
from largebatch.config import save as save_config
from largebatch.errors import UserError
from largebatch.layout import autocast, resize_batch, to_model_layout, use_channels_last  # noqa: F401 (re-exported)
from largebatch.models.classifier import Classifier, build_classifier  # noqa: F401 (re-exported)
from largebatch.progress import Progress
from largebatch.schedule import Plan, resolution_at


def _no_buffer_broadcast() -> dict:
    """DDP keyword for "do not broadcast buffers every forward": torch >= 2.13 spells it
    forward_sync_buffers (broadcast_buffers is deprecated there); older releases broadcast_buffers."""
    params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}



class Trainer:
    def __init__(self, cfg: Config, run_dir: Path | None = None, *, resume: bool = False, quiet: bool = False):
        # what `close` stops, present even when building fails part-way
        self.watchdog: reliability.Watchdog | None = None
        self.comm_state = None
        self.claim: rundir.Claim | None = None
        self.train_data = self.test_data = None
        try:
            self._build(cfg, run_dir, resume, quiet)
        except BaseException:
            self.close()
            raise

    def _build(self, cfg: Config, run_dir: Path | None, resume: bool, quiet: bool) -> None:
        from largebatch.data import build_data
        from largebatch.optim import build_optimizer

        self.cfg = cfg
        t = cfg.train
        # 1. device, process group, threads
        self.device = dist_mod.pick_device(t.device)
        if t.precision == "fp16" and self.device.type != "cuda":
            raise UserError("train.precision fp16 needs a CUDA device (dynamic loss scaling); use bf16 on CPU.")
        self.info = dist_mod.init(self.device, cfg.comm.timeout_s)
        self.threads = dist_mod.set_threads(t.threads, self.info.local_world_size)
        self.main = self.info.is_main
        if t.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        # reliability (largebatch/reliability.py): control store, watchdog, stop agreement, fault knob
        self.store = reliability.control_store(self.info.world_size, cfg.comm.timeout_s)
        self.watchdog = reliability.Watchdog(self.store, self.info.rank, self.info.world_size, cfg.comm.timeout_s)
        self.stop = reliability.StopAgreement(self.info.distributed, self.device)
        self.faults = reliability.FaultInjector(self.info.rank)

        # 2. run directory (rank 0 decides and locks it, everyone agrees; largebatch/rundir.py)
        self.run_dir = self._agree_run_dir(run_dir, resume)
        self.ckpt_dir = self.run_dir / "checkpoints"

        # 3. data
        self.train_data, self.test_data, self.data_info = build_data(cfg.data, t.seed)
        reliability.preflight(self.info, config_hash=cfg.hash(), train_size=len(self.train_data),
                              test_size=len(self.test_data))

        # 4. the step plan: phases, accumulation, lr per step
        self.plan = Plan(cfg.batch, cfg.optim, cfg.schedule, world_size=self.info.world_size,
                         train_size=len(self.train_data), ensemble_cfg=cfg.ensemble)
        self.total_steps = min(self.plan.total_steps, t.max_steps or self.plan.total_steps)

        # 5. model
        torch.manual_seed(t.seed)   # identical initial weights on every rank and every world size
        self.channels_last = use_channels_last(t.channels_last, self.device, t.precision)
        model = build_classifier(cfg, self.data_info).to(self.device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model
        self.ema = None
        if t.ema:
            self.ema = torch.optim.swa_utils.AveragedModel(
                model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(t.ema), use_buffers=True)

        # 6. data parallelism and the communication hook
        self.ddp = model
        if self.info.distributed:
            self.ddp = nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device] if self.device.type == "cuda" else None,
                bucket_cap_mb=cfg.comm.bucket_mb, gradient_as_bucket_view=True,
                **_no_buffer_broadcast())   # BN statistics per worker (Goyal); averaged before eval/checkpoints
            if cfg.comm.algorithm != "native" or cfg.comm.compression != "none":
                from largebatch.comm import register

                self.comm_state = register(self.ddp, cfg.comm)   # the section's set fields are the options
        self.forward = torch.compile(self.ddp) if t.compile else self.ddp

        # 7. optimizer (lr set per step from the plan)
        self.optimizer = build_optimizer(cfg.optim, model, lr=self.plan.lr(0))
        # Collapsed Ensemble: weight decay x factor in collapses (from these base values), snapshot steps.
        self.base_weight_decay = [g["weight_decay"] for g in self.optimizer.param_groups]
        self.snapshot_steps = set(self.plan.snapshot_steps())
        self.criterion_smoothing = t.label_smoothing

        # 8. precision
        self.scaler = torch.amp.GradScaler("cuda", enabled=t.precision == "fp16")
        # gradient noise scale on logging steps (largebatch/noise_scale.py)
        self.noise = None
        if t.noise_scale:
            if self.info.distributed:
                from largebatch.noise_scale import NoiseScale

                self.noise = NoiseScale()
            elif self.main:
                print("largebatch: warning: train.noise_scale needs 2 or more workers (it compares each worker's "
                      "gradient with the all-reduced one); not measured in this run.", file=sys.stderr)
        self._noise_rec: dict = {}

        # 9. state that checkpoints carry
        self.step = 0
        self.progress = Progress()
        self.nonfinite_run = 0
        if resume:
            self._restore()

        self.metrics = metrics_mod.MetricsLog(self.run_dir / "metrics.jsonl", enabled=self.main)
        self.display = metrics_mod.ProgressDisplay(self.total_steps, self.step, enabled=self.main and not quiet)
        self.quiet = quiet
        if self.main and not (self.run_dir / "config.yaml").exists():   # also a --resume that found nothing
            save_config(cfg, self.run_dir / "config.yaml")

    # ------------------------------------------------------------------ run directory
    def _agree_run_dir(self, run_dir: Path | None, resume: bool) -> Path:
        """Rank 0 picks the directory and claims it (refused if it holds a run and this is no resume, or if
        another process writes it); the path, or rank 0's refusal, is broadcast so every rank raises the
        same UserError (exit code 2 on every rank)."""
        path = [str(run_dir) if run_dir else "", ""]   # path, rank 0's error
        if self.main:
            try:
                if not run_dir:
                    stamp = time.strftime("%Y%m%d-%H%M%S")
                    name = Path(self.cfg.recipe).stem
                    # an elastic restart under plain torchrun finds the directory its first attempt chose
                    remembered = reliability.remembered_run_dir(self.store)
                    path[0] = str(remembered or Path("runs") / f"{name}-{stamp}")
                p = Path(path[0])
                self.claim = rundir.claim(p, resume)
                reliability.remember_run_dir(self.store, p)
                (p / "checkpoints").mkdir(exist_ok=True)
            except UserError as err:
                path[1] = str(err)
            except OSError as err:   # the run directory's disk or permissions: still every rank's error
                from largebatch.errors import describe_os_error

                path[1] = describe_os_error(err)
        if self.info.distributed:
            dist.broadcast_object_list(path, src=0)
        if path[1]:
            raise UserError(path[1])
        return Path(path[0])

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else {},
            "step": self.step,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "progress": self.progress.state_dict(self._session_wall()),
            "config_hash": self.cfg.hash(),
            "optimizer_name": self.cfg.optim.name,
            # the comm hook's fields, without its process group (plain data: loads with weights_only)
            "comm": self.comm_state.__getstate__() if self.comm_state is not None else {},
            "noise_scale": self.noise.state_dict() if self.noise is not None else {},
        }

    def save_checkpoint(self) -> None:
        if getattr(self, "_saved_step", None) == self.step:   # already written (e.g. a stop at an epoch end)
            return
        with self.watchdog.guard(self.step, "checkpoint (BN sync + barrier)"):
            self._sync_buffers()   # every rank must hold the same BN statistics when they are written
            if self.main:
                epoch = self.plan.epoch_float(self.step)
                checkpoint.save(self.state_dict(), self.ckpt_dir, self.step, keep=self.cfg.train.keep_checkpoints,
                                meta={"epoch": epoch, "config_hash": self.cfg.hash()})
            if self.info.distributed:
                dist.barrier()
        self._saved_step = self.step

    def _restore(self) -> None:
        found = checkpoint.latest(self.ckpt_dir, warn=(lambda m: print(m, file=sys.stderr)) if self.main else (lambda m: None))
        if found is None:
            if self.main:
                print(f"largebatch: no checkpoint in {self.ckpt_dir}; starting from step 0.", file=sys.stderr)
            return
        path, meta = found
        state = checkpoint.load(path)
        fix = ("resume with the recipe and --set options the run was started with (its config.yaml), or start "
               "a new run with a fresh --run-dir.")
        written_by = state.get("optimizer_name", self.cfg.optim.name)
        if written_by != self.cfg.optim.name:   # its state would load, then fail (or mislead) at the first step
            raise UserError(f"checkpoint {path} was written with optim.name={written_by} but this run uses "
                            f"{self.cfg.optim.name}; {fix}")
        checkpoint.restore(self.model, state["model"], "model", path, fix)
        checkpoint.restore(self.optimizer, state["optimizer"], f"optimizer ({self.cfg.optim.name})", path, fix)
        self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and state["ema"]:
            checkpoint.restore(self.ema, state["ema"], "EMA model", path, fix)
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.step = state["step"]
        if self.noise is not None and state.get("noise_scale"):
            self.noise.load_state_dict(state["noise_scale"])
        self._saved_step = self.step   # that checkpoint exists: a stop right away does not rewrite it
        prog = state["progress"]
        self.progress.load_state_dict(prog)
        if state.get("config_hash") != self.cfg.hash() and self.main:
            print("largebatch: warning: the config differs from the one the checkpoint was written with.",
                  file=sys.stderr)
        if self.main:
            print(f"largebatch: resumed from {path} at step {self.step}.", file=sys.stderr)

    # ------------------------------------------------------------------ helpers
    def _session_wall(self) -> float:
        return time.perf_counter() - self._t_start if hasattr(self, "_t_start") else 0.0

    def _sync_buffers(self) -> None:
        """Average BN running statistics across workers (they are per worker during training)."""
        if self.info.distributed:
            scoring.average_buffers([b for b in self.model.buffers() if b.is_floating_point()], self.info.world_size)

    def _to_device(self, x: torch.Tensor, y: torch.Tensor, size: int | None = None):
        x = to_model_layout(x, self.device, self.channels_last)
        if size is not None and tuple(x.shape[-2:]) != (size, size):
            x = resize_batch(x, size, self.channels_last)
        return x, y.to(self.device, non_blocking=True)

    def _micro_batches(self, epoch: int, start: int, phase):
        """This rank's micro-batch indices for the rest of `epoch` from step-in-epoch `start`."""
        from largebatch.data.sampler import epoch_permutation, rank_batch

        perm = epoch_permutation(len(self.train_data), epoch, self.cfg.train.seed)
        for s in range(start, phase.steps_per_epoch):
            idx = rank_batch(perm, s, phase.global_batch, self.info.rank, self.info.world_size)
            yield from idx.split(phase.micro_batch)

    def _install_signal_handlers(self) -> None:
        self.stop.install()   # SIGTERM / SIGINT set a flag; ranks agree on it every step (reliability.py)

    # ------------------------------------------------------------------ training
    def _train_step(self, micros: list[tuple[torch.Tensor, torch.Tensor]], phase, lr: float,
                    size: int | None = None) -> torch.Tensor:
        t = self.cfg.train
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        # a logging step with train.noise_scale: no DDP all-reduce; allreduce_with_norms below does it
        measure = self.noise is not None and (self.step + 1) % t.log_every == 0
        for i, (x, y) in enumerate(micros):
            x, y = self._to_device(x, y, size)
            last = i == len(micros) - 1 and not measure
            sync = contextlib.nullcontext() if (last or not self.info.distributed) else self.ddp.no_sync()
            with sync:
                with autocast(self.device, t.precision):
                    logits = self.forward(x)
                loss = F.cross_entropy(logits.float(), y, reduction="sum",
                                       label_smoothing=self.criterion_smoothing) / phase.per_worker_batch
                if self.faults.poison(self.step):   # LARGEBATCH_FAULTS=nan@RANK:STEP (debugging knob)
                    loss = loss * float("nan")
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        if measure:
            from largebatch.noise_scale import allreduce_with_norms

            small_sq, big_sq = allreduce_with_norms(
                [p.grad for p in self.model.parameters() if p.grad is not None], self.info.world_size,
                scale=self.scaler.get_scale() if self.scaler.is_enabled() else 1.0)
            self._noise_rec = self.noise.update(small_sq, big_sq, phase.per_worker_batch, phase.global_batch)
        self.scaler.unscale_(self.optimizer)   # LARS and all norms see unscaled fp32 gradients
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        # Gradients are already all-reduced, so every rank reaches the same verdict with no extra
        # communication (a non-finite loss on any rank makes the reduced gradients non-finite too;
        # the local loss itself is not part of the verdict, as ranks could disagree on it).
        # One scalar host sync per step.
        norms = torch._foreach_norm(grads) if grads else [torch.zeros((), device=self.device)]
        ok = bool(torch.isfinite(torch.stack(norms).sum()).item())
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)   # skips the step itself on inf/nan
            self.scaler.update()               # and lowers the loss scale
        elif ok:
            self.optimizer.step()
        if ok:
            self.nonfinite_run = 0
            if self.ema is not None:
                self.ema.update_parameters(self.model)
        else:
            self.progress.nonfinite_total += 1
            self.nonfinite_run += 1
            if self.nonfinite_run > t.max_nonfinite:
                raise UserError(f"training diverged: {self.nonfinite_run} consecutive steps with non-finite loss or "
                                f"gradients at step {self.step}; lower optim.lr, lengthen schedule.warmup_epochs "
                                "or use optim.name=lars.")
        return loss_sum

    def fit(self) -> dict:
        """Train to the end (or to an agreed stop); the summary. Stops the watchdog's publisher after."""
        try:
            return self._fit()
        finally:
            self.close()

    def close(self, timeout_s: float = 30.0) -> bool:
        """Step 1 of the ordered teardown (then `dist.shutdown`: barrier, destroy the groups): stop and join
        every thread of ours that touches the control store or a process group (the watchdog's publisher,
        the comm hook's thread, the pipeline's cross-level worker), stop the data loaders, release the run
        directory. Idempotent. True when every thread ended; a thread that did not is recorded so the
        process exits without interpreter finalization (`dist.end_process`)."""
        joined = True
        if self.watchdog is not None and not self.watchdog.close(timeout_s):
            joined = False
            dist_mod.note_stuck_thread("largebatch-watchdog")
        if self.comm_state is not None and not self.comm_state.close(timeout_s):
            joined = False
            dist_mod.note_stuck_thread("largebatch-comm")
        pipeline = sys.modules.get("largebatch.comm.pipeline")
        if pipeline is not None and not pipeline.shutdown(timeout_s):
            joined = False
            dist_mod.note_stuck_thread("largebatch-cross")
        for source in (self.train_data, self.test_data):
            if hasattr(source, "close"):
                source.close()
        if self.claim is not None:   # the run directory is free for the next writer (e.g. --resume)
            self.claim.release()
            self.claim = None
        return joined

    def _step_batches(self):
        """The batch source: (phase, micro-batches, seconds waited for them) for every step until `total_steps`. It owns the boundaries:
        a fresh loader at each epoch start, phase change and collapse boundary (augmentation off in a
        collapse), resuming mid-epoch where `self.step` is. Time spent waiting for data goes to `_data_wait`."""
        while self.step < self.total_steps:
            phase = self.plan.phase_at(self.step)
            epoch, in_epoch = self.plan.position(self.step)
            collapse = self.plan.in_collapse(self.step)
            batches = iter(self.train_data.batches(self._micro_batches(epoch, in_epoch, phase), train=not collapse,
                                                   epoch=epoch))
            self.model.train()
            for _ in range(phase.steps_per_epoch - in_epoch):
                if self.step >= self.total_steps or self.step >= phase.start_step + phase.steps \
                        or self.plan.in_collapse(self.step) != collapse:
                    break
                t0 = time.perf_counter()
                micros = [next(batches) for _ in range(phase.accumulation)]
                wait = time.perf_counter() - t0
                self._data_wait += wait
                yield phase, micros, wait

    def _fit(self) -> dict:
        """while step < total: train_step; maybe snapshot, log, checkpoint; stop if every rank agreed; at an
        epoch end maybe evaluate, then checkpoint."""
        self._t_start = time.perf_counter()
        self._install_signal_handlers()
        epoch_ends = set(self.plan.epoch_end_steps())
        self._last_log = (time.perf_counter(), self.progress.images_seen, self.step)
        self._loss_acc = torch.zeros((), device=self.device)
        self._data_wait = 0.0
        stopped = False
        try:
            for phase, micros, wait in self._step_batches():
                t0 = time.perf_counter()
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
                    self._end_epoch()
        finally:
            self.display.close()
            if self.comm_state is not None:
                self.comm_state.close()
        if stopped:
            self.save_checkpoint()
            if self.main:
                workers = f" --nproc-per-node {self.info.world_size}" if self.info.distributed else ""
                print(f"largebatch: stopped by signal at step {self.step}; checkpoint written. Resume with: "
                      f"largebatch train {self.cfg.recipe}{workers} --run-dir {self.run_dir} --resume "
                      "(and the same --set options)", file=sys.stderr, flush=True)
            self.metrics.close()
            return {"stopped": True, "step": self.step, "signal": self.stop.signum}
        return self._finish()

    def _one_step(self, phase, micros: list, lr: float) -> bool:
        """One optimizer step (with the Collapsed Ensemble's weight decay and the stop agreement); True when
        every rank agreed to stop after it."""
        if self.plan.segments:
            ensemble.set_weight_decay(self.optimizer, self.base_weight_decay, self.plan.weight_decay_factor(self.step))
        self.faults.before_step(self.step)   # LARGEBATCH_FAULTS debugging knob; no-op when unset
        with self.watchdog.guard(self.step, "training step (stop flag + gradient all-reduce)"):
            self.stop.start()                 # async flag all-reduce, overlaps the step
            self._loss_acc += self._train_step(micros, phase, lr, resolution_at(
                self.cfg.data.resolution_phases, self.plan.epoch_float(self.step)))
            stop_now = self.stop.agreed()
        self.progress.images_seen += phase.global_batch
        self.step += 1
        return stop_now

    def _log_train(self, phase, lr: float) -> None:
        """A logging step: the only host syncs besides the per-step finiteness flag."""
        last_t, last_images, last_step = self._last_log
        n = self.step - last_step
        loss = self._loss_acc / max(n, 1)
        if self.info.distributed:
            dist.all_reduce(loss)
            loss /= self.info.world_size
        now = time.perf_counter()
        rec = {"kind": "train", "step": self.step, "epoch": round(self.plan.epoch_float(self.step), 4),
               "loss": float(loss), "lr": lr, "global_batch": phase.global_batch,
               "images_per_s": (self.progress.images_seen - last_images) / max(now - last_t, 1e-9),
               "data_wait_s": self._data_wait / max(n, 1), "nonfinite_steps": self.progress.nonfinite_total,
               "time": self.progress.wall_before + self._session_wall(), **self._noise_rec}
        self._noise_rec = {}
        self.metrics.write(rec)
        self.display.update(rec)
        self._loss_acc.zero_()
        self._data_wait = 0.0
        self._last_log = (now, self.progress.images_seen, self.step)

    def _end_epoch(self) -> None:
        """Evaluate every `eval_every` epochs (and at the end), then checkpoint."""
        every = self.cfg.train.eval_every
        completed_epoch = self.plan.position(self.step - 1)[0] + 1
        if (every and completed_epoch % every == 0) or self.step == self.total_steps:
            self._log_eval()
        self.save_checkpoint()

    # ------------------------------------------------------------------ evaluation
    def _eval_model(self) -> nn.Module:
        return self.ema.module if self.ema is not None else self.model

    def _log_eval(self) -> dict:
        with self.watchdog.guard(self.step, "evaluation"):
            self._sync_buffers()
            result = scoring.evaluate(self._eval_model(), self.test_data, self.info, self.device,
                                      precision=self.cfg.train.precision, channels_last=self.channels_last,
                                      flip=self.cfg.train.eval_flip,
                                      batch=max(256, self.plan.phase_at(max(self.step - 1, 0)).micro_batch))
        self.progress.best_top1 = max(self.progress.best_top1, result["top1"])
        rec = {"kind": "eval", "step": self.step, "epoch": round(self.plan.epoch_float(self.step), 4), **result, "time": self.progress.wall_before + self._session_wall()}
        self.metrics.write(rec)
        if self.main and not self.quiet:
            self.display.message(f"eval step {self.step}: top-1 {result['top1']:.4f}  top-5 {result['top5']:.4f}  "
                                 f"loss {result['loss']:.4f}")
        self.last_eval = result
        return result

    def _save_snapshot(self) -> None:
        """Collapsed Ensemble: keep the collapsed weights (BN statistics averaged over ranks first)."""
        self._sync_buffers()
        if self.main:
            ensemble.save_snapshot(self.model, self.run_dir, self.step, self.plan.epoch_float(self.step))
        if self.info.distributed:
            dist.barrier()

    def _ensemble_eval(self) -> dict:
        """Every snapshot, their softmax-average ensemble (and SWA): a metrics record and summary keys."""
        states, metas = ensemble.load_states(self.run_dir)
        swa_batches = None
        if self.cfg.ensemble.swa:
            swa_batches = ensemble.bn_batches(len(self.train_data), self.info.rank, self.info.world_size,
                                              self.plan.phases[-1].micro_batch, self.cfg.train.seed)
        result = ensemble.evaluate_snapshots(
            self.model, states, self.test_data, self.info.rank, self.info.world_size, self.device,
            precision=self.cfg.train.precision, channels_last=self.channels_last,
            batch=max(256, self.plan.phases[-1].micro_batch),
            swa_source=self.train_data if self.cfg.ensemble.swa else None, swa_batches=swa_batches)
        rec = ensemble.report(result, metas)
        self.metrics.write({"kind": "ensemble", "step": self.step, **rec})
        if self.main and not self.quiet:
            self.display.message(f"ensemble of {len(states)} snapshots: top-1 {rec['ensemble_top1']:.4f} "
                                 f"(best snapshot {rec['best_snapshot_top1']:.4f})")
        return rec

    def _finish(self) -> dict:
        if not hasattr(self, "last_eval"):
            self._log_eval()
        # Collapsed Ensemble: only once a snapshot exists (a run stopped early by max_steps may have none).
        has_snapshot = any(s <= self.step for s in self.plan.snapshot_steps())
        ensemble_rec = self._ensemble_eval() if has_snapshot else {}
        wall = self.progress.wall_before + self._session_wall()
        corrupt = list(getattr(self.train_data, "corrupt", [])) + list(getattr(self.test_data, "corrupt", []))
        if self.info.distributed:   # every rank skipped its own share of the corrupt files
            with self.watchdog.guard(self.step, "gather corrupt-image lists"):
                lists = [None] * self.info.world_size
                dist.all_gather_object(lists, corrupt)
            corrupt = [path for part in lists for path in part]
        corrupt = sorted(set(corrupt))   # a file is met once per epoch and per evaluation: count it once
        summary = {
            "recipe": self.cfg.recipe, "run_dir": str(self.run_dir),
            "final_top1": self.last_eval["top1"], "final_top5": self.last_eval["top5"],
            "final_loss": self.last_eval["loss"], "best_top1": max(self.progress.best_top1, self.last_eval["top1"]),
            "epochs": round(self.plan.epoch_float(self.step), 4),
            "steps": self.step, "wall_s": wall,
            "train_images_per_s": self.progress.images_seen / max(self.progress.train_time, 1e-9),
            "world_size": self.info.world_size, "global_batch": self.plan.phase_at(self.step - 1).global_batch,
            "nonfinite_steps": self.progress.nonfinite_total, "corrupt_images": len(corrupt),
            "precision": self.cfg.train.precision, "threads_per_worker": self.threads,
            **ensemble_rec,
        }
        if self.main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            if corrupt:
                (self.run_dir / "corrupt_images.txt").write_text("\n".join(sorted(set(corrupt))) + "\n")
            if self.cfg.train.plots:
                metrics_mod.plot(metrics_mod.read(self.run_dir / "metrics.jsonl"), self.run_dir / "plots")
            if self.cfg.train.tensorboard:
                metrics_mod.write_tensorboard(self.run_dir)
        self.metrics.close()
        return summary
