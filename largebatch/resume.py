"""What a resume may change (docs/reliability.md, "What a resume may change"): the policy the trainer applies
before it loads a checkpoint (largebatch/checkpoint.py, which leaves the judging of settings to its caller).

A resume continues one run. A key either says how the run is executed, logged and checkpointed, or how long it
goes on (RESUMABLE: accepted, recorded in config.yaml and as a "resume" entry in metrics.jsonl, and said in one
line), or it is part of what the run is (every other key: refused, unless named in `--allow-change`, then
accepted and recorded the same way). Default-deny: a key added later is part of what the run is until it is
listed here. The keys the run's steps and epochs are counted in (RESUME_NEVER) cannot change even so.
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

from largebatch.config import SECTIONS, Config, shown
from largebatch.config.fields import _item_from_dict, _item_types, _suggest
from largebatch.config.loading import _upgrade_saved
from largebatch.errors import UserError

RESUMABLE = frozenset({
    "schedule.epochs",                  # more (or fewer) epochs: the decay is stretched from the resumed step on
    "batch.micro_batch", "batch.accumulation",   # the same global batch split otherwise, like another world size
    "data.loader_workers", "data.on_corrupt", "data.decode", "data.gpu_decoder", "data.gpu_cache_gb",
    "data.train_size",
    "train.device", "train.precision", "train.channels_last", "train.compile", "train.compile_mode",
    "train.cuda_graph", "train.threads", "train.device_memory_gb", "train.deterministic",
    "train.log_every", "train.eval_every", "train.eval_flip", "train.ema", "train.noise_scale",
    "train.checkpoint_every", "train.keep_checkpoints", "train.max_steps", "train.max_nonfinite",
    "train.tensorboard", "train.plots",
    "comm.bucket_mb", "comm.timeout_s", "comm.grid", "comm.pipeline", "comm.impl", "comm.local_size", "comm.inter",
    "comm.small_bytes",
    "ensemble.swa",
})
RESUME_NEVER = ("batch.global_batch", "batch.phases")


def _flat(data: Any) -> dict[str, Any]:
    """`section.key` -> value of a config mapping (a Config's `to_dict()` or a run's config.yaml)."""
    if not isinstance(data, dict):
        return {}
    return {f"{section}.{key}": value for section in SECTIONS if isinstance(data.get(section), dict)
            for key, value in data[section].items()}


def resume_changes(old: dict, new: Config) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for every key whose value differs from `old` (the config a checkpoint was written
    with); a key that `old` lacks (written by an older version) is not compared."""
    before, after = _flat(_upgrade_saved(old) if isinstance(old, dict) else old), _flat(new.to_dict())
    items = {f"{name}.{key}": cls for name, section in SECTIONS.items() for key, cls in _item_types(section).items()}
    for key, cls in items.items():
        if isinstance(before.get(key), list):   # as the typed loader reads them (a phase without lr: lr None)
            with contextlib.suppress(UserError, TypeError):
                before[key] = [dataclasses.asdict(_item_from_dict(key, cls, v)) for v in before[key]]
    if new.batch.phases:   # derived from the phases, which are compared
        after.pop("batch.global_batch")
    return [(key, before[key], value) for key, value in after.items() if key in before and before[key] != value]


def check_allow_change(keys: list[str]) -> list[str]:
    """The keys of `--allow-change` (repeatable, or comma-separated): each a config key that is part of what a run
    is; one sentence naming the first that is not."""
    flat = [k.strip() for item in keys for k in item.split(",") if k.strip()]
    valid = list(_flat(Config().to_dict()))
    for key in flat:
        if key not in valid:
            raise UserError(f"--allow-change {key}: no such setting{_suggest(key, valid)}; name a section.key of the "
                            "config, e.g. --allow-change data.root.")
        if key in RESUME_NEVER:
            raise UserError(f"--allow-change {key}: a run's steps and epochs are counted in batches of "
                            f"{' and '.join(RESUME_NEVER)}, so a resume cannot change them; start a new run with a "
                            "fresh --run-dir (batch.phases changes the batch during a run when given from its start).")
    return flat


def check_resume(changes: list[tuple[str, Any, Any]], allowed: list[str], run_dir: Path) -> None:
    """Refuse, in one sentence naming the settings with their old and new values and the fix, a resume that changes
    a key the run's steps are counted in, or one that is part of what the run is and not in `allowed`."""
    never = [c for c in changes if c[0] in RESUME_NEVER]
    if never:
        listed = ", ".join(f"{k} {shown(a)} -> {shown(b)}" for k, a, b in never)
        back = " ".join(f"--set {k}={shown(a)}" for k, a, _ in never)
        raise UserError(f"--resume of {run_dir} would change {listed}, the batches its steps and epochs are counted "
                        f"in, so the epoch count would jump; resume with {back}, or start a new run with a fresh "
                        "--run-dir (batch.phases changes the batch during a run when given from its start).")
    refused = [c for c in changes if c[0] not in RESUMABLE and c[0] not in allowed]
    if refused:
        listed = ", ".join(f"{k} {shown(a)} -> {shown(b)}" for k, a, b in refused)
        back = " ".join(f"--set {k}={shown(a)}" for k, a, _ in refused)
        allow = " ".join(f"--allow-change {k}" for k, _, _ in refused)
        raise UserError(f"--resume of {run_dir} would change what the run is: {listed}; resume with {back} (its "
                        f"config.yaml), start a new run with a fresh --run-dir, or, if the run should go on so "
                        f"changed (e.g. the same data moved to another data.root), add {allow} to accept and record "
                        "the change.")
