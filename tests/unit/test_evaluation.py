"""largebatch.evaluation: the one evaluation of the trainer, `largebatch evaluate` and the Collapsed Ensemble.
Counts on hand-made scores, sharded evaluation on 2 gloo processes equal to 1 process, the BN-buffer
average over ranks, and the ensemble of one snapshot scoring as that model does."""
import datetime
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from largebatch import ensemble, evaluation
from largebatch.dist import DistInfo, end_process


class TinySource:
    """The interface of largebatch.data sources that scoring uses: len() and batches(index batches)."""

    def __init__(self, n: int = 101, classes: int = 7, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 1, 4, 4, generator=gen)
        self.y = torch.randint(0, classes, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.y)

    def batches(self, index_batches, train: bool, epoch: int):
        for idx in index_batches:
            yield self.x[idx], self.y[idx]


def tiny_model(classes: int = 7) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(48, classes))


def test_counts_on_hand_made_scores():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.5, 0.4, 0.1]])
    labels = torch.tensor([0, 1, 2])
    c = evaluation.counts(probs.log(), labels).tolist()
    # top-1 hits: row 0 only; top-5 (here all 3 classes): every row
    assert c[:2] == [1.0, 3.0] and c[3] == 3.0
    assert c[2] == pytest.approx(-(math.log(0.7) + math.log(0.3) + math.log(0.1)))
    assert evaluation.as_metrics(c)["top1"] == pytest.approx(1 / 3)
    assert evaluation.counts(torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64)).tolist() == [0.0] * 4


def test_flip_averages_the_logits_of_the_mirror():
    model, source = tiny_model(), TinySource()
    plain = torch.cat([lp for lp, _ in evaluation.shard_log_probs(model, source, 0, 1, torch.device("cpu"))])
    flipped = torch.cat([lp for lp, _ in evaluation.shard_log_probs(model, source, 0, 1, torch.device("cpu"), flip=True)])
    model.eval()
    with torch.no_grad():
        want = ((model(source.x) + model(source.x.flip(3))) / 2).log_softmax(1)
    assert torch.allclose(flipped, want, atol=1e-6) and not torch.allclose(plain, flipped, atol=1e-3)


def test_one_snapshot_ensemble_scores_as_the_model():
    model, source = tiny_model(), TinySource()
    single = evaluation.evaluate(model, source, DistInfo(), torch.device("cpu"), batch=16)
    res = ensemble.evaluate_snapshots(model, [model.state_dict()], source, 0, 1, torch.device("cpu"), batch=16)
    for member in (res["snapshots"][0], res["ensemble"]):
        assert member["count"] == single["count"] == 101
        assert member["top1"] == single["top1"]
        assert member["loss"] == pytest.approx(single["loss"], rel=1e-5)


def _two_ranks(rank: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        model, source = tiny_model(), TinySource()
        res = evaluation.evaluate(model, source, DistInfo(rank=rank, world_size=2),
                               torch.device("cpu"), batch=16)
        buf = torch.full((3,), float(rank + 1))
        evaluation.average_buffers([buf], 2)
        out.put((rank, res, buf.tolist()))
        out.close()
        out.join_thread()   # the result is in the pipe before the exit below
    finally:
        dist.destroy_process_group()
    end_process(0, ran_group=True)   # exit without interpreter finalization while gloo threads live (largebatch.dist)


