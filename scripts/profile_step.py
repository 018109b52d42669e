"""Where one training step of the default recipe's model spends its time (docs/benchmarks.md at f9c730e).

    .venv/bin/python scripts/profile_step.py [--width 12] [--batch 256] [--no-profile]
        [--variants cl,nchw,relu,compile] [--rounds 3]

SpeedrunNet (channels_last, one thread, fp32) on random 28 x 28 inputs, nesterov SGD and label
smoothing as in recipes/fashion_mnist.yaml: images/s over 20 steps after 5 warm-up steps, then a
torch.profiler table of 5 steps (operators by self CPU time). Run two copies at once
(`... & ...; wait`) to see what the two workers of `make train` get each.

With --variants, no profile: each variant's images/s, the variants interleaved round by round (this
machine drifts by up to 20% between runs). cl = the recipe's model; nchw = NCHW memory format;
relu = ReLU instead of GELU; compile = torch.compile of the cl model (its compile time, i.e. the first
5 steps, is printed).
"""
import argparse
import time

import torch

from largebatch.models.flops import count_macs
from largebatch.models.speedrun import SpeedrunNet
from largebatch.optim import SGD
from largebatch.step import local_step

ap = argparse.ArgumentParser()
ap.add_argument("--width", type=int, default=12)
ap.add_argument("--batch", type=int, default=256)
ap.add_argument("--no-profile", action="store_true")
ap.add_argument("--variants", default="", help="comma-separated: cl, nchw, relu, compile")
ap.add_argument("--rounds", type=int, default=3)
args = ap.parse_args()

torch.set_num_threads(1)


def make_step(variant: str):
    """One training step of `variant` on its own model, optimizer and batch: the product's step
    (largebatch.step.local_step) with its fused SGD."""
    torch.manual_seed(0)
    net = SpeedrunNet(num_classes=10, width=args.width, act="relu" if variant == "relu" else "gelu")
    fmt = torch.contiguous_format if variant == "nchw" else torch.channels_last
    net = net.to(memory_format=fmt)
    step = local_step(net, SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True), device=torch.device("cpu"),
                      channels_last=variant != "nchw", label_smoothing=0.1,
                      forward=torch.compile(net) if variant == "compile" else net)
    xb = torch.randn(args.batch, 1, 28, 28).contiguous(memory_format=fmt)
    yb = torch.randint(0, 10, (args.batch,))

    def one() -> None:
        step([(xb, yb)], 0.1)
    return one


if args.variants:
    steps = {}
    for v in args.variants.split(","):
        if v not in ("cl", "nchw", "relu", "compile"):
            ap.error(f"unknown variant {v!r}; choose from cl, nchw, relu, compile")
        steps[v] = make_step(v)
        t0 = time.perf_counter()
        for _ in range(5):
            steps[v]()
        print(f"{v}: first 5 steps (warm-up{', compilation' if v == 'compile' else ''}) "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    for r in range(args.rounds):
        for v, one in steps.items():
            t0 = time.perf_counter()
            for _ in range(20):
                one()
            print(f"round {r + 1} {v}: {20 * args.batch / (time.perf_counter() - t0):.0f} img/s", flush=True)
    raise SystemExit(0)

step = make_step("cl")
for _ in range(5):
    step()
t0 = time.perf_counter()
for _ in range(20):
    step()
dt = (time.perf_counter() - t0) / 20
macs = count_macs(SpeedrunNet(num_classes=10, width=args.width), (1, 1, 28, 28))
print(f"width {args.width}, batch {args.batch}: {dt * 1e3:.1f} ms per step, {args.batch / dt:.0f} img/s, "
      f"{3 * 2 * macs * args.batch / dt / 1e9:.1f} GFLOP/s (3 x forward)")
if not args.no_profile:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
