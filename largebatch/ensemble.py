"""The Collapsed Ensemble (Codreanu, Podareanu, Saletore, "Scale out for large minibatch SGD",
arXiv 1711.04291): snapshots of collapsed models, averaged at test time.

The schedule half (segments, collapse windows, lr per step) is in `largebatch.schedule.Plan`;
this module holds what happens to the weights:

1. Train the base schedule; its last `collapse_epochs` are a collapse (augmentation off,
   weight decay x `collapse_wd_factor`, lr poly-2 to zero). Save snapshot 1 at its end.
2. K cycles: re-warm-up to `cycle_lr_factor` x the peak lr, poly-2 decay, collapse, snapshot.
   All snapshots are kept in RUN_DIR/snapshots (checkpoint.save: atomic, checksummed). A file there that is
   not a snapshot of this run's model (a foreign or malicious file, loaded with weights_only=True: no code
   runs) is one sentence naming it, before any evaluation (`load_states`, `evaluate_run`).
3. Evaluation with `largebatch.evaluation` (each rank its contiguous shard of the test set, every
   image exactly once): for every snapshot, the softmax of its logits on the rank's shard;
   per-snapshot top-1/top-5/NLL, and the ensemble's from the running average of the softmax
   outputs, p_ens = (1/K) sum_k softmax(f_k(x)). One all-reduce of all counts.
4. Optionally (ensemble.swa), the weight average of the snapshots (SWA-style, Izmailov et al.)
   with BN statistics recomputed by forward passes over training batches in train mode
   (cumulative average, then averaged over ranks), evaluated beside the output ensemble.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from largebatch import checkpoint, evaluation
from largebatch.errors import UserError

SNAPSHOT_DIR = "snapshots"


# ---------------------------------------------------------------------------- 1.-2. snapshots
def save_snapshot(model: nn.Module, run_dir: Path, step: int, epoch: float) -> Path | None:
    """Write the (already rank-synchronised) weights of a collapsed model; all snapshots are kept. None: not
    written, its weights are not finite (checkpoint.save)."""
    return checkpoint.save({"model": model.state_dict(), "step": step}, Path(run_dir) / SNAPSHOT_DIR, step,
                           keep=None, meta={"epoch": epoch, "kind": "snapshot"})


def list_snapshots(run_dir: Path) -> list[tuple[Path, dict]]:
    """Intact snapshots of a run, oldest first (a corrupt one is left out; one whose metadata has no step is
    `foreign`)."""
    found = checkpoint.all_intact(Path(run_dir) / SNAPSHOT_DIR)
    for path, meta in found:
        step = meta.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise foreign(path, f"its metadata has step {step!r}")
    return sorted(found, key=lambda pm: pm[1]["step"])


def foreign(path: Path, why: str) -> UserError:
    """A file in snapshots/ that is not a snapshot of this run's model, in one sentence."""
    return UserError(f"snapshot {path} is not a largebatch snapshot of this run ({why}); move it and its .json out "
                     f"of {path.parent}, then evaluate again.")


def set_weight_decay(optimizer: torch.optim.Optimizer, base: list[float], factor: float) -> None:
    """Collapse: every group's weight decay is its base value times `factor` (groups with 0 stay 0)."""
    for group, wd in zip(optimizer.param_groups, base):
        group["weight_decay"] = wd * factor


# ---------------------------------------------------------------------------- 3. evaluation
def shard_probs(model: nn.Module, source, rank: int, world_size: int, device: torch.device, *,
                precision: str = "fp32", channels_last: bool = False, flip: bool = False, batch: int = 512
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax outputs (float32, on `device`) and labels of this rank's contiguous test shard; with `flip`, of
    the logits averaged over each image and its mirror (train.eval_flip, as the run's own evaluation)."""
    parts = list(evaluation.shard_log_probs(model, source, rank, world_size, device, precision=precision,
                                         channels_last=channels_last, flip=flip, batch=batch))
    if not parts:
        return torch.zeros(0, 0, device=device), torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat([lp for lp, _ in parts]).exp(), torch.cat([y for _, y in parts])


def _counts(probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return evaluation.counts(probs.clamp_min(1e-12).log(), labels)


@torch.no_grad()
def evaluate_snapshots(model: nn.Module, states: list[dict], test_source, rank: int, world_size: int,
                       device: torch.device, *, precision: str = "fp32", channels_last: bool = False,
                       flip: bool = False, batch: int = 512, swa_source=None, swa_batches: list | None = None
                       ) -> dict:
    """Step 3 (and 4 with `swa_source`): every snapshot, their softmax-average ensemble and
    optionally the BN-recomputed weight average. All ranks call it; results are global. `flip` scores every
    member as the run's own evaluation does (train.eval_flip), so the ensemble compares with a single model.

    `states` are model state dicts; `model` is a module of the same architecture (not modified).
    """
    if not states:
        raise UserError("the run has no snapshots to ensemble; train with ensemble.cycles > 0 "
                        "(snapshots are saved in RUN_DIR/snapshots).")
    work = copy.deepcopy(model)
    rows, total, labels = [], None, None
    for state in states:
        work.load_state_dict(state)
        probs, labels = shard_probs(work, test_source, rank, world_size, device, precision=precision,
                                    channels_last=channels_last, flip=flip, batch=batch)
        rows.append(_counts(probs, labels))
        total = probs if total is None else total.add_(probs)
    assert total is not None and labels is not None   # states is not empty
    rows.append(_counts(total / len(states), labels))
    if swa_source is not None:
        work.load_state_dict(average_states(states))
        recompute_bn(work, swa_source, swa_batches or [], device, channels_last=channels_last, precision=precision,
                     world_size=world_size)
        probs, labels = shard_probs(work, test_source, rank, world_size, device, precision=precision,
                                    channels_last=channels_last, flip=flip, batch=batch)
        rows.append(_counts(probs, labels))
    table = evaluation.reduce_rows(torch.stack(rows), world_size)   # one collective for every member's counts
    out: dict[str, Any] = {"snapshots": [evaluation.as_metrics(r) for r in table[:len(states)]],
                           "ensemble": evaluation.as_metrics(table[len(states)])}
    out["swa"] = evaluation.as_metrics(table[len(states) + 1]) if swa_source is not None else None
    return out


# ---------------------------------------------------------------------------- 4. weight average
def average_states(states: list[dict]) -> dict:
    """Element-wise mean of the floating-point entries; integer buffers from the last state."""
    out = {}
    for key, value in states[-1].items():
        if value.is_floating_point():
            out[key] = torch.stack([s[key].float() for s in states]).mean(0).to(value.dtype)
        else:
            out[key] = value.clone()
    return out


@torch.no_grad()
def recompute_bn(model: nn.Module, source, index_batches: list, device: torch.device, *, channels_last: bool,
                 precision: str, world_size: int) -> None:
    """BN running statistics of `model` from scratch: cumulative average over the given training
    batches in train mode, then the mean over ranks (all ranks must call it)."""
    from largebatch.placement import autocast, to_model_layout

    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    momenta = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None            # cumulative moving average over the batches
    model.train()
    for x, _ in source.batches(index_batches, train=True, epoch=0):
        x = to_model_layout(x, device, channels_last)
        with autocast(device, precision):
            model(x)
    for m, momentum in zip(bns, momenta):
        m.momentum = momentum
    evaluation.average_buffers([b for m in bns for b in (m.running_mean, m.running_var) if b is not None], world_size)
    model.eval()


def bn_batches(train_size: int, rank: int, world_size: int, micro_batch: int, seed: int,
               max_images: int = 16384) -> list[torch.Tensor]:
    """This rank's share of up to `max_images` training images (epoch 0's order) in micro-batches."""
    from largebatch.data.sampler import epoch_permutation

    perm = epoch_permutation(train_size, 0, seed)[:min(train_size, max_images)]
    per_rank = perm.numel() // world_size
    mine = perm[rank * per_rank:(rank + 1) * per_rank]
    return list(mine.split(max(micro_batch, 1)))


def load_states(run_dir: Path, model: nn.Module | None = None) -> tuple[list[dict], list[dict]]:
    """(model state dicts, metadata) of a run's intact snapshots, oldest first. Loaded with weights_only=True; a
    file that torch cannot load so, holds no model state, or (given `model`) does not fit `model` is `foreign`."""
    found = list_snapshots(run_dir)
    probe = copy.deepcopy(model) if model is not None else None
    states = []
    for path, _ in found:
        try:
            state = checkpoint.load(path)
        except Exception as err:   # noqa: BLE001 - intact by its metadata, yet no weights-only torch file
            raise foreign(path, f"torch.load failed: {' '.join(str(err).split())[:120] or type(err).__name__}") \
                from None
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise foreign(path, "no model state in it")
        if probe is not None:
            checkpoint.restore(probe, state["model"], "run's model", path,
                               f"move it and its .json out of {path.parent}, then evaluate again.")
        states.append(state["model"])
    return states, [m for _, m in found]


def report(result: dict, metas: list[dict]) -> dict:
    """The JSON-friendly record: one row per snapshot (step, epoch, top-1, top-5, loss) and the ensemble."""
    snaps = [{"step": m["step"], "epoch": m.get("epoch"), **r} for m, r in zip(metas, result["snapshots"])]
    best = max(s["top1"] for s in snaps)
    rec = {"snapshots": snaps, "ensemble_top1": result["ensemble"]["top1"], "ensemble_top5": result["ensemble"]["top5"],
           "ensemble_loss": result["ensemble"]["loss"], "best_snapshot_top1": best,
           "ensemble_gain": result["ensemble"]["top1"] - best}
    if result.get("swa"):
        rec.update({"swa_top1": result["swa"]["top1"], "swa_top5": result["swa"]["top5"],
                    "swa_loss": result["swa"]["loss"]})
    return rec


def evaluate_run(model: nn.Module, run_dir: Path, train_source, test_source, info, device: torch.device, *,
                 batch: int, bn_batch: int, seed: int, precision: str, channels_last: bool,
                 swa: bool, flip: bool) -> tuple[dict, int]:
    """A run's snapshots, their softmax-average ensemble (and SWA, BN recomputed on training batches of
    `bn_batch` images), evaluated in batches of `batch` (with `flip`: over each image and its mirror): (the `report` record, the number of snapshots). All
    ranks call it."""
    states, metas = load_states(run_dir, model)
    swa_batches = bn_batches(len(train_source), info.rank, info.world_size, bn_batch, seed) if swa else None
    result = evaluate_snapshots(model, states, test_source, info.rank, info.world_size, device, precision=precision,
                                channels_last=channels_last, flip=flip, batch=batch,
                                swa_source=train_source if swa else None, swa_batches=swa_batches)
    return report(result, metas), len(states)
