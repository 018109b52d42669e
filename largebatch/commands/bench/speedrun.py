"""`largebatch bench speedrun`: the plain PyTorch baseline of the Fashion-MNIST time-to-accuracy record, for
`largebatch train fashion_mnist_speedrun` to be compared with.

The program a user would write without largebatch, timed like the record (training and evaluation, setup
excluded):

1. Data: the IDX files as float32 tensors in [0, 1], normalised with the usual (0.2860, 0.3530), in a
   ``TensorDataset`` behind a shuffling ``DataLoader`` (batch --batch), no augmentation.
2. Model: the classic small CNN (the Keras MNIST example): conv 3x3 32 -> ReLU -> conv 3x3 64 -> ReLU ->
   2x2 max-pool -> dropout 0.25 -> linear 9216 -> 128 -> ReLU -> dropout 0.5 -> linear 10. fp32, NCHW, eager.
3. Optimiser: ``torch.optim.SGD(lr=--lr, momentum=0.9)``, constant lr, cross-entropy.
4. After every epoch: test top-1 on the 10,000 test images (timed). Stop at the first epoch that reaches
   --target, or when the training wall time passes --budget seconds (default 600: the issue's "best within
   10 minutes"). Report the time to the target (or that it was not reached), the best top-1, and the top-1
   of the last evaluation finished within 120 s.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from largebatch.checkpoint import atomic_write
from largebatch.commands.bench.baselines import plain_cnn, plain_epoch
from largebatch.cli import ArgumentParser
from largebatch.errors import UserError

MEAN, STD = 0.2860, 0.3530


def load(root: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1: float32 normalised images and labels of both splits."""
    from largebatch.data import idx

    def split(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = idx.load_split(root, name)
        return (x.float() / 255 - MEAN) / STD, y.long()

    return (*split("train"), *split("t10k"))


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="largebatch bench speedrun", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--root", default="/usr/share/datasets/fashion-mnist", help="directory of the IDX files")
    p.add_argument("--target", type=float, default=0.94, help="test top-1 to reach")
    p.add_argument("--budget", type=float, default=600.0, help="training wall-time limit in seconds, checked after each epoch (so at least one epoch runs)")
    p.add_argument("--epochs", type=int, default=100, help="epoch limit")
    p.add_argument("--batch", type=int, default=128, help="images per step")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of initialisation and shuffling")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    from largebatch.cli import check_numbers, check_output_path
    from largebatch.config import check_threads

    check_numbers(("--batch", args.batch, args.batch >= 1, "1 or more"),
                  ("--epochs", args.epochs, args.epochs >= 1, "1 or more"),
                  ("--budget", args.budget, args.budget > 0, "a positive number of seconds"),
                  ("--lr", args.lr, 0 < args.lr < math.inf, "a positive learning rate"),
                  ("--seed", args.seed, -2**63 <= args.seed < 2**64, "a 64-bit integer"),
                  ("--target", args.target, 0 < args.target <= 1, "a top-1 fraction in (0, 1]"))
    check_threads("--threads", args.threads)
    if not Path(args.root).is_dir():   # named as the flag it is (the IDX reader names its config key data.root)
        what = "is a file, not a directory" if Path(args.root).exists() else "does not exist"
        raise UserError(f"--root {args.root} {what}; give the directory of the Fashion-MNIST IDX files "
                        "(apt-get install -y dataset-fashion-mnist installs them in the default --root).")
    check_output_path("--json", args.json)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_x, train_y, test_x, test_y = load(args.root)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(train_x, train_y), batch_size=args.batch,
                                         shuffle=True)
    model = plain_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    history, reached, t_train = [], None, 0.0
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        model.train()
        plain_epoch(model, opt, loader)   # step 3
        model.eval()
        with torch.no_grad():   # step 4: evaluation is timed
            correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in zip(test_x.split(1000), test_y.split(1000)))
        t_train += time.perf_counter() - t0
        top1 = correct / len(test_y)
        history.append({"epoch": epoch, "top1": top1, "time_s": t_train})
        print(f"epoch {epoch}: top-1 {top1:.4f} at {t_train:.1f} s", flush=True)
        if top1 >= args.target:
            reached = t_train
            break
        if t_train > args.budget:
            break
    within_120 = [h["top1"] for h in history if h["time_s"] <= 120]
    out = {"target": args.target, "time_to_target_s": reached, "best_top1": max(h["top1"] for h in history),
           "top1_within_120s": within_120[-1] if within_120 else None, "epochs": len(history),
           "threads": torch.get_num_threads(), "batch": args.batch, "lr": args.lr, "seed": args.seed,
           "history": history}
    print(f"plain PyTorch CNN: {'reached ' + format(args.target, '.1%') + f' in {reached:.1f} s' if reached else 'did not reach ' + format(args.target, '.1%')}; "
          f"best top-1 {out['best_top1']:.4f} in {t_train:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(args.json, (json.dumps(out, indent=2)).encode())   # whole or absent
    return 0


if __name__ == "__main__":
    from largebatch.errors import report

    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as err:
        sys.exit(report(err))
