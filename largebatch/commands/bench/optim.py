"""Optimizer step time on a model's parameters: LARS and LAMB against torch.optim.SGD(foreach=True).

Run: python -m largebatch.commands.bench.optim [--model resnet50] [--steps 20] [--threads N] [--device cpu]

1. Build the model (ImageNet stem, 1000 classes) and the two parameter groups of `param_groups`.
2. Give every parameter a fixed random gradient (the step does not depend on where it came from).
3. Per optimizer (Nesterov momentum 0.9, weight decay 1e-4): 3 warm-up steps, then time `steps`
   single steps, each closed by a device synchronisation (CUDA) so that the time covers the kernels.
4. Print median and minimum milliseconds per step, and the ratio of medians to SGD.
"""
from __future__ import annotations

import statistics
import time

import torch

from largebatch.cli import ArgumentParser
from largebatch.config import OptimConfig, check_threads
from largebatch.errors import UserError
from largebatch.models import MODELS, build_model, check_model_name
from largebatch.optim import OPTIMIZERS, build_optimizer


def time_steps(opt: torch.optim.Optimizer, steps: int, device: torch.device) -> list[float]:
    """Step 3: seconds of each of `steps` optimizer steps after 3 warm-up steps."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # host sync: the measured region must cover the kernels

    for _ in range(3):
        opt.step()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="largebatch bench optim", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", help=f"one of {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per optimizer")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise UserError(f"--steps is {args.steps}; it must be at least 1.")
    check_threads("--threads", args.threads)
    check_model_name(args.model, "--model")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise UserError(f"--device is {args.device!r}; give cpu or cuda (or cuda:N).")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA device is available; use --device cpu.")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    # 1.-2. Model, groups, fixed gradients.
    torch.manual_seed(0)
    model = build_model(args.model, num_classes=1000).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p).mul_(1e-3)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {n / 1e6:.1f} M parameters in {len(list(model.parameters()))} tensors, "
          f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    # 3.-4. Time each optimizer.
    medians = {}
    for name in OPTIMIZERS:
        opt = build_optimizer(OptimConfig(name=name, nesterov=True, weight_decay=1e-4), model, lr=0.1)
        times = time_steps(opt, args.steps, device)
        medians[name] = statistics.median(times)
        print(f"{name:5s} median {medians[name] * 1e3:7.1f} ms  min {min(times) * 1e3:7.1f} ms  "
              f"x{medians[name] / medians['sgd']:.2f} of sgd")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
