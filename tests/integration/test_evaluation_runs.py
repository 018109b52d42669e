"""The one distributed evaluation on real gloo processes: every image counted once, buffers averaged."""
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from largebatch import evaluation
from largebatch.dist import DistInfo, end_process
from largebatch.launch import free_port


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


def test_two_processes_count_every_image_once_and_average_buffers():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_two_ranks, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (res, buf)) for r, res, buf in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    single = evaluation.evaluate(tiny_model(), TinySource(), DistInfo(), torch.device("cpu"), batch=16)
    for rank in (0, 1):
        res, buf = got[rank]
        assert res["count"] == 101 and res["top1"] == single["top1"]
        assert res["loss"] == pytest.approx(single["loss"], rel=1e-6)
        assert buf == [1.5, 1.5, 1.5]

