"""The eager step under DDP with gradients as bucket views (largebatch/dist.py wrap_ddp), on a real 1-rank gloo
group in this process: the step zeroes the gradients in place, so they stay views of DDP's buckets from step to
step (set to None, each backward would allocate fresh gradients and the reducer copy them into the buckets), and
the steps equal the same steps without DDP."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from largebatch.dist import wrap_ddp
from largebatch.optim.sgd import SGD
from largebatch.step import local_step

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

CPU = torch.device("cpu")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))


def test_ddp_gradients_stay_bucket_views_across_steps():
    g = torch.Generator().manual_seed(1)
    batches = [[(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g))] for _ in range(4)]
    plain = _model()
    plain_step = local_step(plain, SGD(plain.parameters(), lr=0.1, momentum=0.9), device=CPU)
    plain_losses = [plain_step(micros, 0.1) for micros in batches]

    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = _model()
        ddp = wrap_ddp(model, CPU, bucket_mb=25)   # one bucket: every gradient a view of one storage
        step = local_step(model, SGD(model.parameters(), lr=0.1, momentum=0.9), device=CPU, ddp=ddp)
        body, seen = step.train_step.body, []

        def at_entry(*args, **kwargs):   # the gradients as the step's backward finds them: (zeroed, storage)
            seen.append([None if p.grad is None else (not p.grad.any(), p.grad.untyped_storage().data_ptr())
                         for p in model.parameters()])
            return body(*args, **kwargs)
        step.train_step.body = at_entry
        losses, buckets = [], []
        for micros in batches:
            losses.append(step(micros, 0.1))
            grads = [p.grad for p in model.parameters()]
            assert all(gr is not None for gr in grads)
            buckets.append({gr.untyped_storage().data_ptr() for gr in grads})
        # DDP rebuilds its buckets once, at the second step's forward (in the order the gradients became ready);
        # from then on one bucket, every step
        assert all(len(b) == 1 for b in buckets) and buckets[1] == buckets[2] == buckets[3]
        assert seen[0] == [None] * 4   # before the first backward: no gradients yet
        for k in range(1, 4):   # zeroed in place: still the views of the bucket the last step left
            assert seen[k] == [(True, *buckets[k - 1])] * 4, k
    finally:
        dist.destroy_process_group()
    for a, b in zip(plain_losses, losses):
        assert torch.equal(a, b)
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)
