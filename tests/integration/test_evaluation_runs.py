"""The one distributed evaluation on real gloo processes: every image counted once, buffers averaged."""

import pytest
import torch
import torch.multiprocessing as mp
from test_evaluation import TinySource, _two_ranks, tiny_model  # the helpers of its unit tests, one copy

from largebatch import evaluation
from largebatch.dist import DistInfo
from largebatch.launch import free_port


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

