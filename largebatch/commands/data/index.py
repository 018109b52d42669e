"""`largebatch data index ROOT`: count the samples of WebDataset shards into an index.json beside them (the
walk and the writer: largebatch/data/wds.py, `index`).
"""
from __future__ import annotations

from largebatch.cli import ArgumentParser
from largebatch.data.wds import index
from largebatch.errors import UserError


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="largebatch data index",
                       description="count the samples of WebDataset shards into an index.json beside them")
    p.add_argument("root", help="the shards' directory (with its train/ and val/ folders) or a brace pattern")
    args = p.parse_args(argv)
    try:
        index(args.root)
    except OSError as err:
        raise UserError(f"data index could not write beside the shards of {args.root}: {err.strerror or err}; "
                        "give a writable directory (the shards were not touched).") from None
    return 0
