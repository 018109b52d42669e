"""Scoring a model on a sharded data set: one implementation for the trainer's evaluation,
`largebatch evaluate` and the Collapsed Ensemble (`largebatch.ensemble`).

1. Shards: each rank scores its contiguous shard (`data.sampler.eval_shard`), so every image is
   counted exactly once, without padding.
2. Scores: log-probabilities per batch, under autocast; with `flip` the logits of the image and
   its mirror are averaged first (test-time augmentation).
3. Counts: [top-1 correct, top-5 correct, NLL sum, count] in float64 on the device, summed over
   batches without a host sync.
4. One all-reduce of every count row, one host read.

`average_buffers` is the other collective of evaluation: the mean over ranks of a list of tensors
(BatchNorm running statistics, which are per worker during training) in one all-reduce.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from largebatch.errors import UserError


@torch.no_grad()
def shard_log_probs(model: nn.Module, source, rank: int, world_size: int, device: torch.device, *,
                    precision: str = "fp32", channels_last: bool = False, flip: bool = False,
                    batch: int = 512) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Steps 1-2: (float32 log-probabilities, labels) per batch of this rank's shard, on `device`."""
    from largebatch.data.sampler import eval_shard
    from largebatch.placement import autocast, to_model_layout

    model.eval()
    idx = eval_shard(len(source), rank, world_size)
    for x, y in source.batches(list(idx.split(batch)), train=False, epoch=0):
        x = to_model_layout(x, device, channels_last)
        with autocast(device, precision):
            logits = model(x).float()
            if flip:
                logits = (logits + model(x.flip(3)).float()) / 2
        yield logits.log_softmax(1), y.to(device)


def counts(log_probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Step 3: [top-1 correct, top-5 correct, NLL sum, count] (float64, on the labels' device)."""
    if labels.numel() == 0:
        return torch.zeros(4, dtype=torch.float64, device=labels.device)
    top5 = log_probs.topk(min(5, log_probs.shape[1]), dim=1).indices
    hit = top5 == labels[:, None]
    nll = -log_probs.gather(1, labels[:, None]).sum()
    return torch.stack([hit[:, 0].sum().double(), hit.any(1).sum().double(), nll.double(),
                        torch.tensor(float(labels.numel()), dtype=torch.float64, device=labels.device)])


def reduce_rows(table: torch.Tensor, world_size: int) -> list:
    """Step 4: the count rows summed over ranks (one collective, one host read); one row for a 1-D table."""
    if world_size > 1:
        dist.all_reduce(table)
    return table.cpu().tolist()


def as_metrics(row: list[float]) -> dict:
    """A count row as top-1 / top-5 / mean NLL / count."""
    n = max(row[3], 1.0)
    return {"top1": row[0] / n, "top5": row[1] / n, "loss": row[2] / n, "count": int(row[3])}


def average_buffers(tensors: list[torch.Tensor], world_size: int) -> None:
    """Replace each tensor by its mean over ranks, all in one all-reduce (all ranks must call it)."""
    if world_size < 2 or not tensors:
        return
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    dist.all_reduce(flat)
    flat /= world_size
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


@torch.no_grad()
def evaluate(model: nn.Module, source, info, device: torch.device, *, precision: str = "fp32",
             channels_last: bool = False, flip: bool = False, batch: int = 512) -> dict:
    """Steps 1-4 for one model: top-1, top-5, loss and count over the whole data set, on every rank.

    The model is left in train mode; average its BN statistics over ranks first if they differ."""
    total = torch.zeros(4, dtype=torch.float64, device=device)
    for log_probs, y in shard_log_probs(model, source, info.rank, info.world_size, device, precision=precision,
                                        channels_last=channels_last, flip=flip, batch=batch):
        total += counts(log_probs, y)
    row = reduce_rows(total, info.world_size if info.distributed else 1)
    model.train()
    if row[3] == 0:
        raise UserError("evaluation saw no test images: every one was corrupt or unreadable, or the test set is "
                        "empty; check data.root (the skipped files are listed in the run's corrupt_images.txt).")
    return as_metrics(row)
