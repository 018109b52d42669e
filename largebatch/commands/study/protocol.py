"""The protocol of every study kind, as data: each kind's optimizer settings or variants and the papers' claims
with their verdict rules live in `protocol.yaml` beside this file; a study's --protocol (an experiment file's
`protocol:`) replaces its keys for that study (`of`). The figures a table row gives beyond top-1 are code here,
as the tables show them. `kinds.KINDS` puts them together with the code that reads them; nothing here runs.

1. Read: `protocol.yaml` (`default`), or a study's --protocol (`given`: a YAML file, or a mapping written inline,
   as an experiment file passes it).
2. Merge: the given keys replace the package's: `claims` and `baseline` whole, `optimizers` setting by setting
   (lars with another optim.lr is still lars; a new name adds one), `variants` name by name (a variant's list
   whole).
3. Check, one sentence naming the key for anything else: the kind's keys only; optimizer and variant names that
   can name a directory (and not `verdict`, a variant table's row); every optimizer with its optim.name and
   plain values (text, finite numbers, true/false, null, lists; "A/B run" only through an experiment file,
   which knows the epochs); --set items as section.key=value; each claim's row (`cell`) and `against` by the
   kind's fields (batch and optimizer, or variant) naming an optimizer or variant of the protocol, its rule an
   op of `OPS` with a number of points, its `also` rules naming a figure that every seed of its own row has; a
   variant kind has one claim, read against another variant; batch-scaling's baseline one of its optimizers.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from largebatch.errors import UserError

PACKAGE = Path(__file__).with_name("protocol.yaml")
OPS = (">=", ">", "<")
# Each kind's protocol keys and the fields that name its rows (a claim's `cell` and `against`).
KEYS: dict[str, tuple[str, ...]] = {"batch-scaling": ("optimizers", "baseline", "claims"),
                                    "batch-control": ("variants", "claims"), "ensemble": ("variants", "claims")}
AXES: dict[str, tuple[str, ...]] = {"batch-scaling": ("batch", "optimizer"), "batch-control": ("variant",),
                                    "ensemble": ("variant",)}
_NAME = re.compile(r"[A-Za-z0-9_.-]+")   # a group's name is part of its cells' directory names (SLUG-b256-s0)
RESERVED = ("verdict",)                   # a variant table's row of the claim's verdict
VERDICT_KEYS = ("difference", "spread", "holds")   # a variant claim's verdict; its `also` figures join them
RUN_FRACTION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)\s+run\s*$")   # "5/90 run" (experiment files)


@dataclass(frozen=True)
class Figure:
    """A figure a table row gives beyond top-1, from each finished cell's `cell` key: `NAME_mean` over the seeds
    that have it (None without any), or with `spread` `NAME_mean` and `NAME_std` where every seed has it. Only
    `variant`'s rows where given; `column`, `row` and `bar` are how the variant table and chart show it."""
    name: str
    cell: str
    spread: bool = False
    variant: str | None = None
    column: str = ""
    row: str = ""
    bar: str = ""


FIGURES: dict[str, tuple[Figure, ...]] = {
    "batch-scaling": (Figure("train_loss", "train_loss"), Figure("noise_scale", "noise_scale")),
    "batch-control": (),
    "ensemble": (Figure("best_snapshot", "best_snapshot_top1", spread=True, variant="ensemble",
                        column="best snapshot (%)", bar="best snapshot"),
                 Figure("swa", "swa_top1", spread=True, variant="ensemble",
                        row="weight average of the snapshots (SWA, BN recomputed)", bar="SWA")),
}

# A variant whose top-1 is another key of its cells: the ensemble's own (the softmax average of its snapshots).
TOP1: dict[str, dict[str, str]] = {"ensemble": {"ensemble": "ensemble_top1"}}


@dataclass(frozen=True)
class Rule:
    """A claim's verdict rule (`verdict.holds`): `difference OP points / 100`, plus the seeds' spread (the larger
    standard deviation of the two rows) where `beyond_spread`. OP: ">=" (at least), ">" (above), "<" (below)."""
    op: str
    points: float
    beyond_spread: bool = False


@dataclass(frozen=True)
class Also:
    """A further rule on the claim's own row: its top-1 against its figure `figure` (`FIGURES`), recorded as
    `name` and said as `label`."""
    name: str
    label: str
    figure: str
    rule: Rule


@dataclass(frozen=True)
class Claim:
    """A paper's claim: the row it reads (`cell`: its group's fields), measured against `against`'s row (None:
    the kind's baseline, the protocol's `baseline`), held where `rule` and every `also` hold."""
    claim: str
    cell: dict[str, object]
    rule: Rule
    against: dict[str, object] | None = None
    who: str = ""
    also: tuple[Also, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Protocol:
    """A kind's protocol: `optimizers` (batch-scaling: each name's settings), `variants` (the variant kinds: each
    variant's --set items, formatted with the flags), the claims, and batch-scaling's `baseline`."""
    optimizers: dict[str, dict[str, object]]
    variants: dict[str, tuple[str, ...]]
    claims: tuple[Claim, ...]
    baseline: dict[str, object] | None


def given(text: str) -> dict:
    """Step 1, --protocol: a mapping written inline (it starts with "{": JSON, as an experiment file passes it,
    or YAML), or a YAML file of one; read once per process. As recorded with the study (after `of_args` has
    checked it): JSON's values."""
    return json.loads(json.dumps(_given(text)))


@lru_cache(maxsize=8)
def _given(text: str) -> dict:
    import yaml

    from largebatch import safeyaml
    from largebatch.config.loading import YamlLoader

    inline = text.lstrip().startswith("{")
    what = f"--protocol {text[:60]!r}" if inline else f"protocol file {text}"
    if inline:
        source = text
    else:
        path = Path(text)
        if path.is_dir():
            raise UserError(f"--protocol {text} is a directory; give a YAML file of the protocol's keys, or a "
                            "mapping inline ('{...}').")
        try:
            source = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"--protocol {text}: no such file; give a YAML file of the protocol's keys, or a mapping "
                            "inline ('{...}').") from None
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"cannot read {what} ({getattr(err, 'strerror', None) or 'not UTF-8 text'}); give a "
                            "readable YAML file.") from None
    try:
        data = json.loads(source) if inline else None
    except ValueError:
        data = None
    if data is None:
        try:
            data = safeyaml.load(source, YamlLoader)
        except (yaml.YAMLError, safeyaml.TooLarge):
            raise UserError(f"{what} is not valid YAML; give a mapping such as '{{claims: [...]}}'.") from None
    if not isinstance(data, dict) or not data:
        raise UserError(f"{what} gives {'no keys' if not data else 'a ' + type(data).__name__}; give a mapping of "
                        "the keys it replaces (optimizers, baseline, claims; or variants, claims).")
    return data


@lru_cache(maxsize=None)
def _package() -> dict:
    from largebatch.config.loading import load_yaml

    return load_yaml(PACKAGE, what="protocol file")


def of_args(kind: str, args) -> Protocol:
    """The protocol a study's flags give: its --protocol's (`given`, then `of`), else the package's."""
    text = getattr(args, "protocol", None)
    return _of_text(kind, text) if text is not None else default(kind)


@lru_cache(maxsize=8)
def _of_text(kind: str, text: str) -> Protocol:
    return of(kind, _given(text))   # checked as read: `given`'s JSON copy of it is then plain


@lru_cache(maxsize=None)
def default(kind: str) -> Protocol:
    """The package's protocol of `kind` (`protocol.yaml`), one object per kind."""
    return of(kind)


def of(kind: str, mapping: dict | None = None, where: str = "--protocol") -> Protocol:
    """Steps 2-3: the package's protocol of `kind` with `mapping`'s keys in place of its own, checked."""
    data = dict(_package()[kind])
    if mapping is not None:
        _check(isinstance(mapping, dict) and bool(mapping), where,
               f"is {_show(mapping)}; give a mapping of the keys it replaces: {', '.join(KEYS[kind])}")
        unknown = sorted(map(str, set(mapping) - set(KEYS[kind])))
        _check(not unknown, f"{where}", f"has {unknown}; study {kind} takes {', '.join(KEYS[kind])}")
        for key, value in mapping.items():
            if key in ("optimizers", "variants"):
                _check(isinstance(value, dict), f"{where}.{key}", f"is {_show(value)}; give a mapping of names")
                merged = dict(data[key])
                for name, entry in value.items():   # an optimizer's settings key by key, a variant's list whole
                    old = merged.get(name) if isinstance(name, str) else None
                    both = key == "optimizers" and isinstance(old, dict) and isinstance(entry, dict)
                    merged[name] = {**old, **entry} if both else entry   # type: ignore[dict-item]
                value = merged
            data[key] = value
    else:
        where = str(PACKAGE)
    return _build(kind, data, where)


def _plain(value: Any) -> bool:
    """A value a --set item writes as it is: text, a finite number, true/false, null, or a list of them."""
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (str, bool, int)) or (isinstance(value, float) and math.isfinite(value))


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _check(ok: bool, where: str, problem: str) -> None:
    if not ok:
        raise UserError(f"{where} {problem}.")


def _build(kind: str, data: dict, where: str) -> Protocol:
    """Step 3: the checked Protocol of `data`."""
    optimizers: dict[str, dict[str, object]] = {}
    variants: dict[str, tuple[str, ...]] = {}
    for key, table in (("optimizers", optimizers), ("variants", variants)):
        if key not in KEYS[kind]:
            continue
        for name, entry in data[key].items():
            here = f"{where}.{key}.{name}"
            _check(isinstance(name, str) and bool(_NAME.fullmatch(name)) and name not in RESERVED, f"{where}.{key}",
                   f"has the name {name!r}; give letters, digits, _ . - only (it names the cells' directories), "
                   f"and none of {', '.join(RESERVED)}")
            if key == "optimizers":
                _check(isinstance(entry, dict) and all(isinstance(k, str) and "." in k for k in entry), here,
                       f"is {_show(entry)}; give a mapping of section.key to value, e.g. {{optim.name: lars}}")
                _check("optim.name" in entry, here, "has no optim.name; give the optimizer its cells train with "
                                                    "(sgd, lars or lamb)")
                for k, v in entry.items():
                    _check(_plain(v), f"{here}.{k}", f"is {_show(v)}; give a number, text, true/false, null or a "
                                                    "list of them")
                    _check(not (isinstance(v, str) and RUN_FRACTION.match(v)), f"{here}.{k}",
                           f"is {v!r}, a fraction of the run: an experiment file's protocol takes it (it knows the "
                           "study's epochs); here give epochs")
                table[name] = dict(entry)   # type: ignore[assignment]
            else:
                _check(isinstance(entry, list) and bool(entry) and all(isinstance(s, str) and "=" in s
                                                                         for s in entry), here,
                       f"is {_show(entry)}; give a list of --set items, e.g. [\"batch.global_batch={{batch}}\"]")
                table[name] = tuple(entry)   # type: ignore[assignment]
    names = optimizers or variants
    axes = AXES[kind]
    figures = FIGURES[kind]

    def row(value: Any, here: str) -> dict[str, object]:
        _check(isinstance(value, dict) and set(value) == set(axes), here,
               f"is {_show(value)}; give {{{', '.join(f'{a}: ...' for a in axes)}}}")
        name = value["optimizer" if "optimizer" in axes else "variant"]
        _check(isinstance(name, str) and name in names, here,
               f"names {_show(name)}, not one of the protocol's: {', '.join(names)}")
        if "batch" in axes:
            batch = value["batch"]
            _check(isinstance(batch, int) and not isinstance(batch, bool) and batch >= 1, here,
                   f"has batch {batch!r}; give a positive global batch")
        return dict(value)

    def rule(value: Any, here: str) -> Rule:
        _check(isinstance(value, dict) and {"op", "points"} <= set(value) <= {"op", "points", "beyond_spread"},
               here, f"is {_show(value)}; give {{op: OP, points: P}} (optionally beyond_spread: true)")
        _check(value["op"] in OPS, f"{here}.op", f"is {value['op']!r}; give one of {', '.join(OPS)}")
        points = value["points"]
        _check(isinstance(points, (int, float)) and not isinstance(points, bool) and math.isfinite(points),
               f"{here}.points", f"is {points!r}; give a number of points (-1.0: one point below)")
        spread = value.get("beyond_spread", False)
        _check(isinstance(spread, bool), f"{here}.beyond_spread", f"is {spread!r}; give true or false")
        return Rule(value["op"], float(points), spread)

    claims_data = data["claims"]
    _check(isinstance(claims_data, list) and bool(claims_data), f"{where}.claims",
           f"is {_show(claims_data)}; give a list of one or more claims")
    claims = []
    for i, c in enumerate(claims_data):
        here = f"{where}.claims[{i}]"
        allowed = {"claim", "who", "cell", "rule", "against", "also"}
        _check(isinstance(c, dict) and {"claim", "cell", "rule"} <= set(c) <= allowed, here,
               f"is {_show(c)}; give claim, cell and rule (optionally who, against and also)")
        _check(isinstance(c["claim"], str) and isinstance(c.get("who", ""), str), here,
               "has a claim or who that is not text; give each as a sentence")
        against = row(c["against"], f"{here}.against") if c.get("against") is not None else None
        _check(against is not None or kind == "batch-scaling", here,
               "has no against; give the variant it is measured against, e.g. against: {variant: fixed}")
        also = c.get("also") or []
        _check(isinstance(also, list), f"{here}.also", f"is {_show(also)}; give a list")
        cell = row(c["cell"], f"{here}.cell")
        # an `also` reads a figure every seed of the claim's own variant has (`Figure.spread`)
        mine = [f.name for f in figures if f.spread and f.variant is not None and f.variant == cell.get("variant")]
        alsos = []
        for j, a in enumerate(also):
            there = f"{here}.also[{j}]"
            _check(isinstance(a, dict) and set(a) == {"name", "label", "figure", "rule"}, there,
                   f"is {_show(a)}; give name, label, figure and rule")
            _check(a["figure"] in mine, f"{there}.figure",
                   f"is {_show(a['figure'])}; give one of the figures of the claim's row "
                   f"({', '.join(mine) or f'none: {_show(cell)} has no figure to compare with'})")
            _check(isinstance(a["name"], str) and a["name"].isidentifier() and a["name"] not in VERDICT_KEYS
                   and isinstance(a["label"], str), there,
                   f"has name {_show(a['name'])}; give a name of letters, digits and _ (not one of "
                   f"{', '.join(VERDICT_KEYS)}) and a label as text")
            alsos.append(Also(a["name"], a["label"], a["figure"], rule(a["rule"], f"{there}.rule")))
        claims.append(Claim(c["claim"], cell, rule(c["rule"], f"{here}.rule"), against, c.get("who", ""),
                            tuple(alsos)))
    _check(kind == "batch-scaling" or len(claims) == 1, f"{where}.claims",
           f"has {len(claims)} claims; study {kind} judges one (study.json's verdict)")
    baseline = None
    if "baseline" in KEYS[kind]:
        baseline = data["baseline"]
        _check(isinstance(baseline, dict) and set(baseline) == {"optimizer"} and isinstance(baseline["optimizer"], str)
               and baseline["optimizer"] in names,
               f"{where}.baseline", f"is {_show(baseline)}; give {{optimizer: NAME}} with one of the protocol's "
                                    f"optimizers ({', '.join(names)})")
        baseline = dict(baseline)
    return Protocol(optimizers, variants, tuple(claims), baseline)
