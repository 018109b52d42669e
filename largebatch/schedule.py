"""The step plan: global batch per phase, gradient accumulation, and the lr at every step.

Everything here is a pure function of the step, so a resumed run needs nothing but the
step number to continue the same schedule, batch phase and data position.

1. Peak lr from the scaling rule (Goyal): lr_peak = lr * B / 256 (linear) or
   lr * sqrt(B / 256) (sqrt), per phase when the global batch B changes (batch-size
   control, Sony / Smith et al.), unless the phase gives its own lr.
2. Gradual warm-up: per step, linearly from `warmup_start_lr` (default: the unscaled lr,
   0.1 in Goyal's recipe, or the peak lr where that is lower, so a batch below the reference
   batch gets no warm-down) to the peak lr over `warmup_epochs` epochs.
3. Decay after warm-up as a function of the epoch (a float: step / steps_per_epoch):
   step (x gamma at each milestone), poly (to end_lr with `power`, 2 for LARS),
   cosine (to end_lr), or constant.
4. Collapsed Ensemble (Codreanu et al., optional `ensemble` section): the base schedule is the
   first segment; K cycles follow, each a re-warm-up (linear to cycle_lr_factor x the last
   peak lr) then poly-2 decay to zero at the cycle's end. The last `collapse_epochs` of every
   segment are its collapse: lr poly-2 from its value at the collapse start to zero, weight
   decay x collapse_wd_factor, augmentation off; a snapshot is taken at each segment's end
   (the base run's end is snapshot 1). See largebatch/ensemble.py.
Momentum correction when the lr changes is the optimizer's business (see optim/lars.py;
torch's SGD applies lr after momentum, which is the corrected form).
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from largebatch.errors import UserError


def ensemble_epochs(e) -> float:
    """Epochs the Collapsed Ensemble adds after the base run (config.EnsembleConfig): its cycles or segments."""
    if e.segments:
        return float(sum(g.epochs for g in e.segments))
    return e.cycles * e.cycle_epochs if e.cycles > 0 else 0.0


def scaled_lr(lr: float, global_batch: int, reference_batch: int = 256, rule: str = "linear") -> float:
    """Peak lr for `global_batch` from an lr given for `reference_batch` images."""
    ratio = global_batch / reference_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    if rule == "none":
        return lr
    raise ValueError(f"unknown scaling rule {rule!r}")


def decay_factor(epoch: float, *, warmup_epochs: float, epochs: float, decay: str,
                 milestones: tuple = (), gamma: float = 0.1, power: float = 2.0,
                 peak: float = 1.0, end: float = 0.0) -> float:
    """lr after warm-up at a (fractional) epoch, going from `peak` at the end of warm-up."""
    if decay == "constant":
        return peak
    if decay == "step":
        return peak * gamma ** bisect.bisect_right(sorted(milestones), epoch)
    span = max(epochs - warmup_epochs, 1e-12)
    t = min(max((epoch - warmup_epochs) / span, 0.0), 1.0)
    if decay == "poly":
        return end + (peak - end) * (1.0 - t) ** power
    if decay == "cosine":
        return end + (peak - end) * 0.5 * (1.0 + math.cos(math.pi * t))
    raise ValueError(f"unknown decay {decay!r}")


def lr_at_epoch(epoch: float, *, peak_lr: float, start_lr: float, warmup_epochs: float, epochs: float,
                decay: str, milestones: tuple = (), gamma: float = 0.1, power: float = 2.0,
                end_lr: float = 0.0) -> float:
    """Warm-up then decay; `epoch` is fractional (step / steps_per_epoch) so warm-up is per step."""
    if warmup_epochs > 0 and epoch < warmup_epochs:
        return start_lr + (peak_lr - start_lr) * epoch / warmup_epochs
    return decay_factor(epoch, warmup_epochs=warmup_epochs, epochs=epochs, decay=decay,
                        milestones=milestones, gamma=gamma, power=power, peak=peak_lr, end=end_lr)


@dataclass(frozen=True)
class Phase:
    """A stretch of whole epochs at one global batch."""
    start_epoch: int
    end_epoch: float
    global_batch: int
    peak_lr: float
    micro_batch: int          # images per worker per forward/backward
    accumulation: int         # micro-batches per optimizer step
    steps_per_epoch: int
    start_step: int           # global step at which the phase starts

    @property
    def per_worker_batch(self) -> int:
        return self.micro_batch * self.accumulation

    @property
    def steps(self) -> int:
        return round((self.end_epoch - self.start_epoch) * self.steps_per_epoch)


@dataclass(frozen=True)
class Segment:
    """Collapsed Ensemble: the base run or one cycle, ending in a collapse and a snapshot; or, with
    `ensemble.segments`, a segment of its own (no collapse, no snapshot) or a collapse (the whole segment)."""
    kind: str                 # "base", "cycle", "segment" or "collapse"
    start_step: int
    collapse_step: int        # first step of the collapse (end_step: none)
    end_step: int             # exclusive; a snapshot is taken after step end_step - 1 where there is a collapse
    rewarm_steps: int         # cycles and segments: linear re-warm-up steps
    peak_lr: float
    start_lr: float = 0.0     # segments: where the re-warm-up starts; collapses: where the poly-2 descent starts
    end_factor: float = 0.0   # segments: the lr at the end as a fraction of the peak


class _OnePhase(NamedTuple):
    start_epoch: int
    global_batch: int
    lr: Optional[float]


def in_start_order(phases: list, where: str) -> list:
    """Phases (batch.phases, data.resolution_phases: anything with a start_epoch) in the order they take effect,
    by start_epoch, listed in any order; two with one start_epoch are ambiguous: one sentence naming both."""
    seen: dict[Any, int] = {}
    for i, phase in enumerate(phases):
        start = phase.start_epoch
        if start in seen:
            raise UserError(f"{where}[{i}].start_epoch is {start:g}, the same as {where}[{seen[start]}]'s; "
                            "phases need strictly increasing start epochs, so give each phase its own.")
        seen[start] = i
    return sorted(phases, key=lambda p: p.start_epoch)


def batch_phases(batch_cfg) -> list:
    """The batch phases of a run in start order (config.BatchPhase); without batch.phases one, batch.global_batch
    from epoch 0 at the scaled lr."""
    return in_start_order(batch_cfg.phases, "batch.phases") or [_OnePhase(0, batch_cfg.global_batch, None)]


def peak_lr(phase, optim_cfg) -> float:
    """Step 1: the peak lr of a batch phase, its own lr or optim.lr scaled to its global batch."""
    if phase.lr is not None:
        return phase.lr
    return scaled_lr(optim_cfg.lr, phase.global_batch, optim_cfg.reference_batch, optim_cfg.scaling_rule)


def resolution_at(phases: list, epoch: float) -> int | None:
    """Training image size at (fractional) `epoch` under progressive resizing, or None for the data's
    own size: the image_size of the last phase whose start_epoch is <= epoch (fast.ai's DAWNBench
    ImageNet runs trained at 128, then 224, then 288 px; FFCV ramps the same way)."""
    size = None
    for p in in_start_order(phases, "data.resolution_phases"):   # config.ResolutionPhase
        if p.start_epoch <= epoch:
            size = p.image_size
    return size


def split_batch(global_batch: int, world_size: int, micro_batch: int | None = None,
                accumulation: int | None = None, where: str = "batch.global_batch") -> tuple[int, int]:
    """(micro_batch, accumulation) with micro_batch x world_size x accumulation == global_batch. A micro-batch
    given alone is a cap (the fewest equal micro-batches of at most that many images); given with an
    accumulation, the two must make the per-worker batch."""
    if global_batch % world_size:
        raise UserError(f"{where} = {global_batch} is not divisible by the world size {world_size}; "
                        f"choose a global batch that is a multiple of {world_size} or change the number of workers.")
    per_worker = global_batch // world_size
    if micro_batch is not None and accumulation is not None and micro_batch * accumulation != per_worker:
        raise UserError(f"batch.micro_batch = {micro_batch} and batch.accumulation = {accumulation} make "
                        f"{micro_batch * accumulation} images per worker, but {where} = {global_batch} over "
                        f"{world_size} workers is {per_worker}; set one of them and leave the other null (it is "
                        "derived), or make them agree.")
    if accumulation is None and micro_batch is not None:
        if micro_batch >= per_worker:
            accumulation = 1
        else:
            accumulation = math.ceil(per_worker / micro_batch)
            while per_worker % accumulation:   # smallest accumulation >= needed that divides evenly
                accumulation += 1
    accumulation = accumulation or 1
    if per_worker % accumulation:
        raise UserError(f"{where} = {global_batch} over {world_size} workers is {per_worker} images per worker, "
                        f"not divisible by batch.accumulation = {accumulation}; "
                        f"pick a global batch divisible by workers x accumulation ({world_size * accumulation}).")
    return per_worker // accumulation, accumulation


class Plan:
    """The resolved schedule of a run: phases, steps and lr per step. Pure and cheap."""

    def __init__(self, batch_cfg, optim_cfg, schedule_cfg, *, world_size: int, train_size: int,
                 ensemble_cfg=None, micro_cap: int | None = None):
        """`micro_cap`: what `batch.micro_batch: auto` resolved to (largebatch/memory.py); None where nothing was
        resolved (no cap: the whole per-worker batch in one pass)."""
        self.schedule = schedule_cfg
        self.optim = optim_cfg
        self.world_size = world_size
        self.train_size = train_size
        self.base_epochs = schedule_cfg.epochs
        self.ensemble = ensemble_cfg if ensemble_cfg is not None and (ensemble_cfg.cycles > 0 or
                                                                      ensemble_cfg.segments) else None
        self.epochs = self.base_epochs + (ensemble_epochs(self.ensemble) if self.ensemble else 0)
        self.start_lr = optim_cfg.lr if schedule_cfg.warmup_start_lr is None else schedule_cfg.warmup_start_lr
        raw = batch_phases(batch_cfg)
        if raw[0].start_epoch != 0:
            raise UserError(f"batch.phases must start at epoch 0 (the first starts at {raw[0].start_epoch}); "
                            "add a phase with start_epoch: 0.")
        phases: list[Phase] = []
        step = 0
        for i, p in enumerate(raw):
            start, gb = p.start_epoch, p.global_batch
            end = raw[i + 1].start_epoch if i + 1 < len(raw) else self.epochs
            if start >= self.epochs:   # after one another (in_start_order); the last ends at the run's end
                raise UserError(f"batch.phases[{i}] starts at epoch {start}, at or after where it ends ({end}); "
                                f"phases need increasing start epochs below schedule.epochs = {self.epochs}.")
            if gb > train_size:
                raise UserError(f"global batch {gb} is larger than the {train_size} training images; "
                                "use a smaller batch.")
            where = f"batch.phases[{i}].global_batch" if batch_cfg.phases else "batch.global_batch"
            cap = batch_cfg.micro_batch   # auto: the memory's cap, unless an accumulation is given (it decides)
            if cap == "auto":
                cap = micro_cap if batch_cfg.accumulation is None else None
            micro, accum = split_batch(gb, world_size, cap, batch_cfg.accumulation, where)
            spe = train_size // gb
            phase = Phase(start, end, gb, float(peak_lr(p, optim_cfg)), micro, accum, spe, step)
            phases.append(phase)
            step += phase.steps
        self.phases = phases
        self.total_steps = step
        # a forward batch that changes between phases (a fixed accumulation, or a cap above a phase's batch): said
        # by the dry run, since it changes BatchNorm's batch and the memory a step needs
        self.notes = [f"the forward batch per worker changes from {a.micro_batch} to {b.micro_batch} images at "
                      f"epoch {b.start_epoch}; set batch.micro_batch to cap it"
                      for a, b in zip(phases, phases[1:]) if a.micro_batch != b.micro_batch]
        if schedule_cfg.warmup_start_lr is None:   # Goyal's warm-up climbs from the unscaled lr to k times it; with
            self.start_lr = min(self.start_lr, phases[0].peak_lr)   # k < 1 (a batch below reference_batch) it
            # would fall from above the peak: start at the peak instead, no warm-down
        if self.total_steps <= 0:
            raise UserError("the schedule has no training steps; train for more epochs or use a smaller batch.")
        self.segments: list[Segment] = self._segments() if self.ensemble else []
        # (epoch, old horizon, new horizon) of each resume that changed the decay's length, oldest first: set by the
        # trainer from the checkpoint (`stretched_epoch`); none for a run's own first schedule
        self.stretches: list[tuple[float, float, float]] = []

    # ------------------------------------------------------------------ Collapsed Ensemble (step 4)
    def step_at_epoch(self, epoch: float) -> int:
        """The first global step at (fractional) `epoch`."""
        phase = self.phases[max(bisect.bisect_right([p.start_epoch for p in self.phases], epoch) - 1, 0)]
        return phase.start_step + round((epoch - phase.start_epoch) * phase.steps_per_epoch)

    def _segments(self) -> list["Segment"]:
        e = self.ensemble
        assert e is not None   # called only with an ensemble
        if e.segments:
            return self._own_segments()
        s = self.schedule
        if e.cycles < 0 or e.collapse_epochs <= 0 or e.rewarm_epochs < 0 or e.cycle_lr_factor <= 0 \
                or e.collapse_wd_factor < 0:
            raise UserError("ensemble needs cycles >= 0, collapse_epochs > 0, rewarm_epochs >= 0, "
                            "cycle_lr_factor > 0 and collapse_wd_factor >= 0; fix the ensemble section.")
        if e.collapse_epochs > s.epochs - s.warmup_epochs:
            raise UserError(f"ensemble.collapse_epochs ({e.collapse_epochs}) is longer than the base schedule after "
                            f"warm-up ({s.epochs - s.warmup_epochs} epochs); shorten the collapse or train longer.")
        if e.cycle_epochs <= e.rewarm_epochs + e.collapse_epochs:
            raise UserError(f"ensemble.cycle_epochs ({e.cycle_epochs}) must be longer than rewarm_epochs + "
                            f"collapse_epochs ({e.rewarm_epochs + e.collapse_epochs}); lengthen the cycle.")
        peak = self.phases[-1].peak_lr * e.cycle_lr_factor
        bounds = [self.base_epochs + k * e.cycle_epochs for k in range(e.cycles + 1)]
        segs = [Segment("base", 0, self.step_at_epoch(bounds[0] - e.collapse_epochs), self.step_at_epoch(bounds[0]),
                        0, self.phases[-1].peak_lr)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            start = self.step_at_epoch(a)
            segs.append(Segment("cycle", start, self.step_at_epoch(b - e.collapse_epochs), self.step_at_epoch(b),
                                self.step_at_epoch(a + e.rewarm_epochs) - start, peak))
        segs[-1] = dataclasses.replace(segs[-1], end_step=self.total_steps)
        for seg in segs:
            if not seg.start_step <= seg.collapse_step < seg.end_step or seg.collapse_step - seg.start_step <= seg.rewarm_steps:
                raise UserError(f"the ensemble {seg.kind} segment at step {seg.start_step} has no room for its "
                                "re-warm-up, decay and collapse at this batch size; use longer cycles or a smaller batch.")
        return segs

    def _own_segments(self) -> list["Segment"]:
        """`ensemble.segments`: the base run (no collapse), then each segment in turn; a segment re-warms from where
        the previous one ended to its peak and decays poly-2 to `end_factor` x its peak; a collapse descends poly-2
        from where the previous one ended to zero."""
        e = self.ensemble
        assert e is not None
        base_end = self.step_at_epoch(self.base_epochs)
        base_peak = self.phases[-1].peak_lr
        segs = [Segment("base", 0, base_end, base_end, 0, base_peak)]
        end_lr = self._segment_lr(segs[0], base_end - 1)   # where the base run stopped
        epoch = float(self.base_epochs)
        for i, g in enumerate(e.segments):
            start, end = self.step_at_epoch(epoch), self.step_at_epoch(epoch + g.epochs)
            epoch += g.epochs
            if end <= start:
                raise UserError(f"ensemble.segments[{i}] ({g.epochs:g} epochs) has no step at this batch size; give "
                                "it more epochs or use a smaller batch.")
            if g.collapse:
                segs.append(Segment("collapse", start, start, end, 0, end_lr, start_lr=end_lr))
                end_lr = 0.0
                continue
            peak = base_peak * g.peak_factor
            segs.append(Segment("segment", start, end, end, self.step_at_epoch(epoch - g.epochs + g.rewarm_epochs) - start,
                                peak, start_lr=end_lr, end_factor=g.end_factor))
            end_lr = peak * g.end_factor
        last = segs[-1]
        segs[-1] = dataclasses.replace(last, end_step=self.total_steps,
                                       collapse_step=last.start_step if last.kind == "collapse" else self.total_steps)
        return segs

    def segment_at(self, step: int) -> "Segment":
        i = bisect.bisect_right([g.start_step for g in self.segments], step) - 1
        return self.segments[max(i, 0)]

    def in_collapse(self, step: int) -> bool:
        """Whether `step` belongs to a collapse (augmentation off, weight decay multiplied)."""
        if not self.segments:
            return False
        seg = self.segment_at(step)
        return seg.collapse_step <= step < seg.end_step

    def weight_decay_factor(self, step: int) -> float:
        return self.ensemble.collapse_wd_factor if self.ensemble is not None and self.in_collapse(step) else 1.0

    def snapshot_steps(self) -> list[int]:
        """Steps (counted after the step) at which a collapsed snapshot is saved."""
        return [g.end_step for g in self.segments if g.collapse_step < g.end_step]

    def _segment_lr(self, seg: "Segment", step: int) -> float:
        if seg.kind == "base":
            s = self.schedule
            return lr_at_epoch(self.epoch_float(step), peak_lr=self.phase_at(step).peak_lr, start_lr=self.start_lr,
                               warmup_epochs=s.warmup_epochs, epochs=s.decay_epochs or s.epochs, decay=s.decay,
                               milestones=tuple(s.milestones), gamma=s.gamma, power=s.power, end_lr=s.end_lr)
        if seg.kind == "collapse":                    # descends from where the previous segment ended
            return seg.start_lr
        k = step - seg.start_step
        if seg.kind == "segment":
            if k < seg.rewarm_steps:                  # linear from where the previous segment ended
                return seg.start_lr + (seg.peak_lr - seg.start_lr) * (k + 1) / seg.rewarm_steps
            t = (k - seg.rewarm_steps) / (seg.end_step - seg.start_step - seg.rewarm_steps)
            return seg.peak_lr * (1.0 - t * (1.0 - math.sqrt(seg.end_factor))) ** 2   # poly-2 to end_factor x peak
        if k < seg.rewarm_steps:                      # re-warm-up, never a zero-lr step
            return seg.peak_lr * (k + 1) / seg.rewarm_steps
        t = (k - seg.rewarm_steps) / (seg.end_step - seg.start_step - seg.rewarm_steps)
        return seg.peak_lr * (1.0 - t) ** 2          # poly-2 to zero at the cycle's end

    def phase_at(self, step: int) -> Phase:
        i = bisect.bisect_right([p.start_step for p in self.phases], step) - 1
        return self.phases[max(i, 0)]

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within that epoch) of a global step."""
        phase = self.phase_at(step)
        done = step - phase.start_step
        return phase.start_epoch + done // phase.steps_per_epoch, done % phase.steps_per_epoch

    def epoch_float(self, step: int) -> float:
        phase = self.phase_at(step)
        return phase.start_epoch + (step - phase.start_step) / phase.steps_per_epoch

    @property
    def horizon(self) -> float:
        """The epochs the decay spans (schedule.decay_epochs, else schedule.epochs)."""
        return float(self.schedule.decay_epochs or self.schedule.epochs)

    def stretched_epoch(self, epoch: float) -> float:
        """`epoch` on the axis of the run's first schedule, through `stretches`: a resume at epoch e that changed
        the decay's horizon from A to B maps every later epoch x to e + (x - e)(A - e)/(B - e), so the lr goes on
        from its value at e and reaches the schedule's end at B (the decay, warm-up or milestones after e, stretched
        or shrunk); the latest stretch first."""
        for at, old, new in reversed(self.stretches):
            if epoch > at and new > at:
                epoch = at + (epoch - at) * (old - at) / (new - at)
        return epoch

    def lr(self, step: int) -> float:
        if self.segments:
            seg = self.segment_at(step)
            if step < seg.collapse_step:
                return self._segment_lr(seg, step)
            u = (step - seg.collapse_step) / (seg.end_step - seg.collapse_step)
            return self._segment_lr(seg, seg.collapse_step) * (1.0 - u) ** 2   # collapse: poly-2 to zero
        s = self.schedule
        phase = self.phase_at(step)
        horizon = self.stretches[0][1] if self.stretches else self.horizon   # the first schedule's
        return lr_at_epoch(self.stretched_epoch(self.epoch_float(step)), peak_lr=phase.peak_lr,
                           start_lr=self.start_lr, warmup_epochs=s.warmup_epochs, epochs=horizon, decay=s.decay,
                           milestones=tuple(s.milestones), gamma=s.gamma, power=s.power, end_lr=s.end_lr)

    def epoch_end_steps(self) -> list[int]:
        """Global steps (exclusive) at which an epoch ends."""
        ends = []
        for p in self.phases:
            for k in range(1, p.steps // p.steps_per_epoch + 1):
                ends.append(p.start_step + k * p.steps_per_epoch)
            if p.steps % p.steps_per_epoch:
                ends.append(p.start_step + p.steps)
        return ends

    def describe(self) -> dict:
        first = self.phases[0]
        return {
            "world_size": self.world_size,
            "train_size": self.train_size,
            "epochs": self.epochs,
            "total_steps": self.total_steps,
            "warmup_steps": round(self.schedule.warmup_epochs * first.steps_per_epoch),
            "warmup_start_lr": self.start_lr,
            "phases": [{
                "start_epoch": p.start_epoch, "end_epoch": p.end_epoch, "global_batch": p.global_batch,
                "per_worker_batch": p.per_worker_batch, "micro_batch": p.micro_batch,
                "accumulation": p.accumulation, "peak_lr": p.peak_lr,
                "steps_per_epoch": p.steps_per_epoch, "steps": p.steps, "start_step": p.start_step,
            } for p in self.phases],
            "ensemble": [{
                "kind": g.kind, "start_step": g.start_step, "collapse_step": g.collapse_step, "end_step": g.end_step,
                "start_epoch": round(self.epoch_float(g.start_step), 4),
                "collapse_epoch": round(self.epoch_float(g.collapse_step), 4),
                "end_epoch": round(self.epoch_float(g.end_step), 4) if g.end_step < self.total_steps else self.epochs,
                "peak_lr": g.peak_lr, "rewarm_steps": g.rewarm_steps,
            } for g in self.segments],
        }
