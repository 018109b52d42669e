"""Speed-run sweeps outside the trainer: one process, the whole loop in ~100 lines, so that a model or
hyperparameter change can be judged in one 2-4 minute run (its sweep: docs/benchmarks.md at f9c730e, "Speed run").
The step is the product's (`largebatch.step.local_step`, with its fused SGD and EMA).

The loop is the speed-run recipe's: Fashion-MNIST resident as uint8, a random flip per image (and with
--crop P a random +-P px translation; both `largebatch.data.memory.MemorySource.crop_flip`, the
trainer's), normalisation in the model, channels_last, Nesterov SGD with weight
decay on conv/linear weights only, linear warm-up from 0 then cosine (or linear) decay per step, label
smoothing. It reports test top-1 with flip TTA (--tta), plus without TTA and with flip + two 1-px shifts.
Differences from `largebatch train`: one process (no DDP, so BN sees the whole batch), warm-up from 0
instead of from the unscaled lr, and `torch.randperm` instead of the keyed sampler.

Run two at a time with one thread each on 2 cores, e.g.
    python scripts/speedrun_sweep.py --threads 1 --lr 1.0 & python scripts/speedrun_sweep.py --threads 1 --lr 0.2
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from largebatch.data.idx import read_idx
from largebatch.data.memory import MemorySource
from largebatch.models import Normalize
from largebatch.models.speedrun import SpeedrunNet
from largebatch.optim import SGD, build_ema
from largebatch.step import local_step

p = argparse.ArgumentParser()
p.add_argument("--width", type=int, default=8)
p.add_argument("--epochs", type=float, default=5)
p.add_argument("--batch", type=int, default=512)
p.add_argument("--lr", type=float, default=0.2)
p.add_argument("--wd", type=float, default=5e-4)
p.add_argument("--ls", type=float, default=0.1)
p.add_argument("--warmup", type=float, default=0.5)
p.add_argument("--crop", type=int, default=0)
p.add_argument("--ema", type=float, default=0)
p.add_argument("--tta", default="flip")
p.add_argument("--scale", type=float, default=0.25)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--decay", default="cosine")
p.add_argument("--act", default="gelu", choices=["gelu", "relu"])
p.add_argument("--evals", type=int, default=0)
a = p.parse_args()
torch.manual_seed(a.seed)
torch.set_num_threads(a.threads)
D = "/usr/share/datasets/fashion-mnist/"
xtr = read_idx(D + "train-images-idx3-ubyte.gz")[:, None]
ytr = read_idx(D + "train-labels-idx1-ubyte.gz").long()
xte = read_idx(D + "t10k-images-idx3-ubyte.gz")[:, None]
yte = read_idx(D + "t10k-labels-idx1-ubyte.gz").long()


def build(width: int, act: str, scale: float) -> nn.Module:
    """Normalize + the package's SpeedrunNet."""
    return nn.Sequential(Normalize([0.2860], [0.3530]), SpeedrunNet(10, 1, width=width, scale=scale, act=act))


model = build(a.width, a.act, a.scale).to(memory_format=torch.channels_last)
decay, no_decay = [], []
for p_ in model.parameters():
    (decay if p_.ndim > 1 else no_decay).append(p_)
lr0 = a.lr
opt = SGD([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0}],
          lr=lr0, momentum=0.9, nesterov=True)
ema = build_ema(model, a.ema or None)
# the product's step (largebatch.step): loss / batch, the finiteness verdict, the fused SGD, the EMA
train_step = local_step(model, opt, device=torch.device("cpu"), channels_last=True, label_smoothing=a.ls, ema=ema)
N = xtr.shape[0]
steps_per_epoch = N // a.batch
total = int(a.epochs * steps_per_epoch)
warm = int(a.warmup * steps_per_epoch)
train_data = MemorySource(xtr, ytr, seed=a.seed, augment=True, padding=a.crop)   # the trainer's crop + flip


def lr_at(s):
    if s < warm:
        return lr0 * (s + 1) / warm
    t = (s - warm) / max(1, total - warm)
    if a.decay == "cosine":
        return lr0 * 0.5 * (1 + math.cos(math.pi * t))
    return lr0 * (1 - t)


def evaluate(m, tta=None):
    tta = a.tta if tta is None else tta
    m.eval(); correct = 0
    with torch.no_grad():
        for i in range(0, 10000, 1000):
            x = xte[i:i + 1000].contiguous(memory_format=torch.channels_last)
            logits = m(x)
            if "flip" in tta:
                logits = logits + m(x.flip(3))
            if "shift" in tta:
                xp = F.pad(x, (1, 1, 1, 1))
                for dy, dx in ((0, 0), (2, 2)):
                    xs = xp[:, :, dy:dy + 28, dx:dx + 28]
                    logits = logits + 0.5 * (m(xs) + m(xs.flip(3)))
            correct += (logits.argmax(1) == yte[i:i + 1000]).sum().item()
    m.train(); return correct / 10000


g = torch.Generator().manual_seed(a.seed)
t0 = time.time(); step = 0; log = []
ep = 0
while step < total:
    perm = torch.randperm(N, generator=g)
    for b in range(steps_per_epoch):
        if step >= total: break
        idx = perm[b * a.batch:(b + 1) * a.batch]
        x = train_data.crop_flip(idx, ep).contiguous(memory_format=torch.channels_last)
        y = ytr[idx]
        train_step([(x, y)], lr_at(step))
        step += 1
    ep += 1
    if a.evals and ep % a.evals == 0 and step < total:
        log.append((ep, round(time.time() - t0, 1), evaluate(model)))
        print(log[-1], flush=True)
acc = evaluate(ema.module if ema is not None else model)
el = time.time() - t0
extra = {"acc_noflip": evaluate(model, "none"), "acc_shift": evaluate(model, "flip,shift")}
if ema is not None: extra["acc_raw_flip"] = evaluate(model, "flip")
print(json.dumps({**vars(a), "acc": acc, "time": round(el, 1), "img_s": round(total * a.batch / el), "log": log, **extra}), flush=True)
