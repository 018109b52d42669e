"""`largebatch data pack SRC_IMAGEFOLDER DST_DIR [--shard-size-mb 64] [--seed 0]`: pack an ImageFolder into
sequential tar shards (the writer: largebatch/data/pack.py; the reader: largebatch/data/shards.py).
"""
from __future__ import annotations

import math
from pathlib import Path

from largebatch.cli import ArgumentParser, check_numbers
from largebatch.data.pack import pack
from largebatch.errors import UserError, shown


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="largebatch data pack", description="pack an ImageFolder into sequential tar shards")
    p.add_argument("src", type=Path, help="ImageFolder root with train/ and val/")
    p.add_argument("dst", type=Path, help="output directory for the shards and index.json")
    p.add_argument("--shard-size-mb", type=float, default=64.0, help="target shard size in MB")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled pack order")
    args = p.parse_args(argv)
    check_numbers(("--shard-size-mb", args.shard_size_mb, 2**-20 <= args.shard_size_mb < math.inf,
                   "a size in MB of at least one byte (2**-20 MB), e.g. 64"),
                  ("--seed", args.seed, -2**63 <= args.seed < 2**64, "a 64-bit integer"))
    if not args.src.is_dir():   # named as the argument it is (the ImageFolder reader names its config key data.root)
        what = "is a file, not a directory" if args.src.exists() else "does not exist"
        raise UserError(f"data pack source {args.src} {what}; give an ImageFolder root with train/ and val/.")
    index = pack(args.src, args.dst, int(args.shard_size_mb * 2**20), args.seed, say=print)
    for split, s in index["splits"].items():
        print(f"{split}: {s['total']} images in {len(s['shards'])} shards -> {shown(args.dst)}")
    return 0
