"""largebatch's pieces in your own training loop: a plain torch DDP loop with LARS (BN and biases excluded by
shape), the warm-up + poly lr schedule with linear scaling, and a largebatch all-reduce as DDP's comm hook.

    torchrun --nproc-per-node 2 examples/own_loop.py [--steps 20] [--algorithm ring]

Synthetic data (a fixed linear rule to learn); prints the first and last loss on rank 0. Any model works: take
yours, or `largebatch.models.build_model("timm:resnet50", 1000)`.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from largebatch import comm
from largebatch.dist import end_process
from largebatch.optim import LARS, param_groups
from largebatch.schedule import lr_at_epoch, scaled_lr

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--algorithm", default="ring", help="a largebatch all-reduce: ring, torus2d, hierarchical, ...")
args = p.parse_args()

dist.init_process_group("gloo")   # the torchrun environment: RANK, WORLD_SIZE, MASTER_ADDR/PORT
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)              # the same initial weights on every rank
model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
ddp = DDP(model)
state = comm.register(ddp, comm.CommHookState(args.algorithm))   # DDP's gradient all-reduce now runs largebatch's algorithm

# 1. The global batch and the peak lr scaled linearly from "5 per 256 images" (LARS takes large lrs).
per_rank = 16
global_batch = per_rank * world
peak = scaled_lr(5.0, global_batch, reference_batch=256)
# 2. LARS: weights adapt layer-wise with weight decay; BN and biases (ndim <= 1) get plain momentum SGD.
optimizer = LARS(param_groups(model, weight_decay=5e-5), lr=peak, momentum=0.9, weight_decay=5e-5)
steps_per_epoch = 10
teacher = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
losses = []
for step in range(args.steps):
    # 3. lr: linear warm-up over 1 epoch, then poly decay to 0 at the end (a pure function of the step).
    lr = lr_at_epoch(step / steps_per_epoch, peak_lr=peak, start_lr=peak / 10, warmup_epochs=1,
                     epochs=args.steps / steps_per_epoch, decay="poly")
    for group in optimizer.param_groups:
        group["lr"] = lr
    # 4. Each rank its own part of the global batch (seeded by step and rank).
    g = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(per_rank, 32, generator=g)
    y = (x @ teacher).argmax(1)
    loss = nn.functional.cross_entropy(ddp(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()               # gradients averaged across ranks by the hook
    optimizer.step()
    losses.append(loss.item())    # a host sync: fine in an example, avoid it every step in real training
state.close()                     # the hook's communication thread ends before the process group does
if rank == 0:
    print(f"world {world}, global batch {global_batch}, peak lr {peak:.4f}: "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
dist.destroy_process_group()
# 5. Exit without interpreter finalization: once DDP has used a gloo group, gloo's threads outlive
#    destroy_process_group, and one releasing a tensor while Python finalizes aborts the process ("terminate
#    called without an active exception", exit -6) after a run that succeeded (docs/reliability.md, Teardown).
end_process(0, ran_group=True)
