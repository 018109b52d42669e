"""`largebatch config [PREFIX ...] [--recipe RECIPE] [--set section.key=value ...] [--markdown]`

Every config key with its type, default, bounds and what it does, read from the dataclasses of
largebatch/config/ (`config.reference()`, the one source of docs/config.md too):

1. PREFIX (a section such as ``optim``, or a key such as ``comm.pipeline``) keeps the keys that start with
   it; one that matches no key is one sentence with the closest section or key.
2. --recipe (with --set overrides): also the value each key takes in that recipe, resolved and validated as
   `largebatch train` would.
3. --markdown: docs/config.md itself; `largebatch config --markdown > docs/config.md` regenerates it, and a
   test holds the committed page equal to it.
"""
from __future__ import annotations

import difflib
import sys

from largebatch.cli import ArgumentParser
from largebatch.errors import UserError

TITLE = "Configuration reference"


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="largebatch config", description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("prefix", nargs="*", help="sections or keys to show (default: all), e.g. optim comm.pipeline")
    p.add_argument("--recipe", default=None, help="also show each key's value in this recipe (name or YAML path)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="section.key=value",
                   help="with --recipe: override a key, as for largebatch train (repeatable)")
    p.add_argument("--markdown", action="store_true", help="print docs/config.md (the whole reference as Markdown)")
    return p


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("*", "\\*").replace("\n", " ")


def markdown() -> str:
    """docs/config.md: one table per section, the entries of a list key (a phase) after it."""
    from largebatch import config

    lines = [f"# {TITLE}", "",
             "Every key a recipe (`recipes/*.yaml`) or `--set section.key=value` can set, generated from the "
             "dataclasses of `largebatch/config/schema.py` by `largebatch config --markdown > docs/config.md` (a test "
             "holds this page equal to it). An unknown section or key, a value of the wrong type or outside its "
             "bounds is one sentence naming the key and the fix. `largebatch config PREFIX --recipe NAME` shows "
             "the keys with their values in a recipe. Keys of the comm algorithms come from one table, "
             "`largebatch.comm.options.OPTIONS`; setting one that the chosen `comm.algorithm` does not read is "
             "an error.", ""]
    section = None
    for row in config.reference():
        name = row.key.split(".")[0]
        if name != section:
            section = name
            lines += ["", f"## {name}", "", "| key | type | default | bounds | what it does |", "|---|---|---|---|---|"]
        lines.append(f"| `{row.key}` | {row.type} | `{_cell(row.default)}` | {_cell(row.bounds)} | {_cell(row.doc)} |")
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"


def _select(rows: list, prefixes: list[str]) -> list:
    if not prefixes:
        return rows
    keys = [r.key for r in rows]
    sections = list(dict.fromkeys(k.split(".")[0] for k in keys))
    out = []
    for prefix in prefixes:
        hit = [r for r in rows if r.key.startswith(prefix)]
        if not hit:
            close = difflib.get_close_matches(prefix, sections + keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"no config key starts with {prefix!r}{hint}; give a section ({', '.join(sections)}) "
                            "or a section.key.")
        out += [r for r in hit if r not in out]
    return out


def main(argv: list[str]) -> int:
    from largebatch import config

    args = parser().parse_args(argv)
    if args.markdown:
        if args.prefix or args.recipe or args.overrides:
            raise UserError("--markdown prints the whole reference; give it alone.")
        sys.stdout.write(markdown())
        return 0
    if args.overrides and not args.recipe:
        raise UserError("--set overrides a recipe's key; give --recipe NAME with it.")
    rows = _select(config.reference(), args.prefix)
    values = {}
    if args.recipe:
        flat = config.load(args.recipe, args.overrides).to_dict()
        values = {f"{s}.{k}": v for s, section in flat.items() if isinstance(section, dict) for k, v in section.items()}
    width = max(len(r.key) for r in rows)
    for r in rows:
        bounds = f"  {r.bounds}" if r.bounds else ""
        value = f"  = {config.shown(values[r.key])}" if r.key in values else ""
        print(f"{r.key:<{width}}  {r.type}, default {r.default}{bounds}{value}")
        print(f"{'':<4}{r.doc}")
    return 0
