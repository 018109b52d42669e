"""The checks of a whole config: every section's own (`Section.validate`), then those that span sections (an lr
of the schedule against the peak lr that the batch phases and the optimizer make)."""
from __future__ import annotations

from largebatch.config.schema import SECTIONS, Config
from largebatch.errors import UserError
from largebatch.schedule import batch_phases, peak_lr


def validate(cfg: Config) -> None:
    """Every section's `validate()`, in the order of SECTIONS, then the checks that span sections."""
    for name in SECTIONS:
        getattr(cfg, name).validate()
    _check_end_lr(cfg)
    _check_warmup_start(cfg)


def _peak_lrs(cfg: Config) -> tuple[list[float], str]:
    """The peak lr of each batch phase in start order (`schedule.peak_lr`, as the plan makes them), and where it
    comes from without phases, for a message."""
    o = cfg.optim
    peaks = [peak_lr(p, o) for p in batch_phases(cfg.batch)]
    return peaks, f"optim.lr {o.lr:g} scaled to the global batch {cfg.batch.global_batch}"


def _check_end_lr(cfg: Config) -> None:
    """schedule.end_lr is where poly/cosine decay ends: not above the peak lr of any batch phase, or the decay
    would raise it."""
    s = cfg.schedule
    if s.decay not in ("poly", "cosine"):
        return
    peaks, scaled = _peak_lrs(cfg)
    peak, which = min(peaks), "the smallest of batch.phases" if cfg.batch.phases else scaled
    if s.end_lr > peak:
        raise UserError(f"schedule.end_lr is {s.end_lr:g}, above the peak lr of {peak:g} ({which}), so the {s.decay} "
                        f"decay would raise the lr; give at most {peak:g} (0 decays to zero).")


def _check_warmup_start(cfg: Config) -> None:
    """An explicit schedule.warmup_start_lr is where the gradual warm-up starts, climbing to the first batch
    phase's peak lr: not above it, or the warm-up would lower the lr (the default never starts above it)."""
    s = cfg.schedule
    if s.warmup_start_lr is None or s.warmup_epochs <= 0:
        return
    peaks, scaled = _peak_lrs(cfg)
    peak, which = peaks[0], "the first of batch.phases" if cfg.batch.phases else scaled
    if s.warmup_start_lr > peak:
        raise UserError(f"schedule.warmup_start_lr is {s.warmup_start_lr:g}, above the peak lr of {peak:g} ({which}), "
                        f"so the warm-up would lower the lr; give at most {peak:g}, or null for the default (the "
                        "unscaled lr, or the peak where that is lower).")
