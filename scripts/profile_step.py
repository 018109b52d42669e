"""Where one training step of the default recipe's model spends its time (docs/benchmarks.md).

    .venv/bin/python scripts/profile_step.py [--width 12] [--batch 256] [--no-profile]

SpeedrunNet (channels_last, one thread, fp32) on random 28 x 28 inputs, nesterov SGD and label
smoothing as in recipes/fashion_mnist.yaml: images/s over 20 steps after 5 warm-up steps, then a
torch.profiler table of 5 steps (operators by self CPU time). Run two copies at once
(`... & ...; wait`) to see what the two workers of `make train` get each.
"""
import argparse
import time

import torch
import torch.nn.functional as F

from largebatch.models.flops import count_macs
from largebatch.models.speedrun import SpeedrunNet

ap = argparse.ArgumentParser()
ap.add_argument("--width", type=int, default=12)
ap.add_argument("--batch", type=int, default=256)
ap.add_argument("--no-profile", action="store_true")
args = ap.parse_args()

torch.set_num_threads(1)
model = SpeedrunNet(num_classes=10, width=args.width).to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
x = torch.randn(args.batch, 1, 28, 28).contiguous(memory_format=torch.channels_last)
y = torch.randint(0, 10, (args.batch,))


def step() -> None:
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y, label_smoothing=0.1).backward()
    opt.step()


for _ in range(5):
    step()
t0 = time.perf_counter()
for _ in range(20):
    step()
dt = (time.perf_counter() - t0) / 20
macs = count_macs(model, (1, 1, 28, 28))
print(f"width {args.width}, batch {args.batch}: {dt * 1e3:.1f} ms per step, {args.batch / dt:.0f} img/s, "
      f"{3 * 2 * macs * args.batch / dt / 1e9:.1f} GFLOP/s (3 x forward)")
if not args.no_profile:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
