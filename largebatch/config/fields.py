"""How a config key is declared and checked: the field helpers, each key's bounds on its own field, the `Section`
and `Item` base classes, and the strict reading of one value against its field's type.

A numeric key states its bounds once, on its field, as text the reference shows and `check_bound` reads:
``"> 0"``, ``">= 4"``, or an interval such as ``"(0, 1]"`` or ``"[1, 604800]"``. A value outside them is one
sentence: the field's own (`says`, and `above` where the upper end says something else), with ``{key}``,
``{value}``, ``{bounds}``, ``{low}``, ``{high}`` and the other fields of its section or entry to fill in;
without one, "it must be positive" / "it must be zero or more" for a bound at zero, else "it must be in
{bounds}". `sign` is a bound at zero checked first, with its own sentence, for a key whose range says more.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from largebatch.errors import UserError

SAYS_POSITIVE = "{key} is {value}; it must be positive."
SAYS_ZERO_OR_MORE = "{key} is {value}; it must be zero or more."
SAYS_IN_BOUNDS = "{key} is {value}; it must be in {bounds}."


def _choices(*values: str, doc: str) -> Any:
    return field(default=values[0], metadata={"choices": values, "doc": doc})


def _required(doc: str, **meta: Any) -> Any:
    """A field of a list entry (`Item`) that the recipe must give: no default."""
    return field(metadata={"doc": doc, "required": True, **meta})


def _doc(default: Any, doc: str, **meta: Any) -> Any:
    """A field with its default and doc; `meta` may hold its `bounds` (and the sentences `says`, `above`, `sign`),
    and `words` a number key also takes ("auto")."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: json.loads(json.dumps(default)), metadata={"doc": doc, **meta})
    return field(default=default, metadata={"doc": doc, **meta})


def _number(text: str) -> int | float:
    number = float(text)
    return int(number) if number.is_integer() else number


@dataclass(frozen=True)
class Bound:
    """A key's bounds as written on its field: ``> 0``, ``>= 4``, ``(0, 1]``, ``[1, 604800]``."""

    low: int | float
    low_open: bool
    high: int | float = math.inf
    high_open: bool = True

    @classmethod
    def parse(cls, text: str) -> "Bound":
        one = re.fullmatch(r"(>=?)\s*(\S+)", text.strip())
        if one:
            return cls(_number(one[2]), one[1] == ">")
        two = re.fullmatch(r"([(\[])\s*(\S+)\s*,\s*(\S+)\s*([)\]])", text.strip())
        if not two:
            raise ValueError(f"bounds {text!r}: write > N, >= N, or an interval such as (0, 1]")
        return cls(_number(two[2]), two[1] == "(", _number(two[3]), two[4] == ")")

    def under(self, value: float) -> bool:
        return value < self.low or (self.low_open and value == self.low)

    def over(self, value: float) -> bool:
        return value > self.high or (self.high_open and value == self.high)

    def sign_sentence(self) -> str | None:
        """The sentence of a bound at zero: positive, or zero or more."""
        if self.low != 0:
            return None
        return SAYS_POSITIVE if self.low_open else SAYS_ZERO_OR_MORE


def check_bound(key: str, value: Any, meta: Any, owner: Any = None) -> None:
    """One sentence when `value` of `key` lies outside the bounds its field states (`meta`: the field's
    metadata; `owner`: its section or entry, whose fields a sentence may name). None ("not set") and a word a
    number key takes ("auto") pass."""
    text = meta.get("bounds")
    if not text or value is None or isinstance(value, str):
        return
    bound, says = Bound.parse(text), None
    sign = Bound.parse(meta["sign"]) if meta.get("sign") else None
    if sign is not None and sign.under(value):
        says = sign.sign_sentence()
    elif bound.under(value):
        says = meta.get("says") or bound.sign_sentence() or SAYS_IN_BOUNDS
    elif bound.over(value):
        says = meta.get("above") or meta.get("says") or SAYS_IN_BOUNDS
    if says is not None:
        names = {f.name: getattr(owner, f.name) for f in dataclasses.fields(owner)} if owner is not None else {}
        raise UserError(says.format(**{**names, "key": key, "value": value, "bounds": text, "low": bound.low,
                                       "high": bound.high}))


def check_fields(owner: Any, where: str) -> None:
    """The bounds of every field of a section or entry, in field order; `where` names it (``optim``,
    ``batch.phases[1]``)."""
    for f in dataclasses.fields(owner):
        check_bound(f"{where}.{f.name}", getattr(owner, f.name), f.metadata, owner)


class Section:
    """A config section. `validate()`: each field's bounds, then the checks that bounds alone cannot express,
    world-size-free (the batch arithmetic that needs the world size is `schedule.Plan`'s); each error names the
    key and the fix. `prefix`: the section's name in a recipe (``model``)."""

    prefix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        """Entries of a list key given as mappings (``BatchConfig(phases=[{...}])`` from code) become their typed
        `Item`s, through the same strict reading as a recipe's."""
        name = self.prefix or type(self).__name__
        for key, cls in _item_types(type(self)).items():
            value = getattr(self, key)
            if isinstance(value, list) and not all(isinstance(v, cls) for v in value):
                setattr(self, key, [_item_from_dict(f"{name}.{key}[{i}]", cls, v) for i, v in enumerate(value)])

    def validate(self) -> None:
        check_fields(self, self.prefix)
        for key in _item_types(type(self)):   # the entries of a list key (phases) check themselves
            for i, item in enumerate(getattr(self, key)):
                item.validate(f"{self.prefix}.{key}[{i}]")


class Item:
    """An entry of a list key (a phase): a dataclass read by the same strict rules as a section, with its own
    bounds and checks. Fields whose metadata says ``required`` must be given."""

    def validate(self, where: str) -> None:
        """Each field's bounds; `where` names the entry (``batch.phases[1]``)."""
        check_fields(self, where)


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _is_number(value: Any) -> bool:
    """A finite int or float (not a bool): what a numeric item of a list key must be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(args[0])} or null"
    words = {int: "whole number", float: "number", str: "string", bool: "boolean (true or false)", list: "list",
             dict: "mapping"}
    return words.get(origin if origin in (list, dict) else tp, getattr(tp, "__name__", str(tp)))


def _coerce(where: str, value: Any, tp: Any, meta: dict) -> Any:
    """Check `value` against the field type `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if isinstance(value, str) and value in meta.get("words", ()):   # a word a number key also takes ("auto")
            return value
        return _coerce(where, value, args[0], meta)
    ok = True
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        given = value
        if isinstance(value, str):   # YAML 1.1 reads 1e4 as a string: take it as the whole number it is
            with contextlib.suppress(ValueError):
                number = float(value.strip())
                value = int(number) if number.is_integer() else value
        elif isinstance(value, float) and value.is_integer():   # 1.0e+4, 64.0: a whole number written as a float
            value = int(value)
        ok = _is_int(value)
        if ok and not -2**63 <= value < 2**63:   # no count, size or seed is larger; torch takes 64-bit integers
            raise UserError(f"{where} is {given}; give a number below 2**63.")
    elif tp is float:
        if isinstance(value, str):   # YAML 1.1 reads 1e-3 (no dot) as a string: take it as the number it is
            with contextlib.suppress(ValueError):
                value = float(value.strip())
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
        if ok and not math.isfinite(value):
            raise UserError(f"{where} is {value}; give a finite number.")
    elif tp is str:
        if isinstance(value, bool) and {"on", "off"} <= set(meta.get("choices", ())):
            value = "on" if value else "off"   # YAML 1.1 reads a bare on/off as a boolean
        ok = isinstance(value, str)
    elif tp is list or origin is list:
        ok = isinstance(value, list)
        item = (typing.get_args(tp) or (None,))[0]
        if ok and isinstance(item, type) and issubclass(item, Item):
            return [_item_from_dict(f"{where}[{i}]", item, entry) for i, entry in enumerate(value)]
    elif tp is dict or origin is dict:
        ok = isinstance(value, dict)
    if not ok:
        fix = "" if "[" in where else f" or with --set {where}=VALUE"   # an entry of a list key: the recipe's
        raise UserError(f"{where} must be a {_type_name(tp)}, got {value!r}; fix it in the recipe{fix}.")
    choices = meta.get("choices")
    if choices and value not in choices:
        raise UserError(f"{where} is {value!r}; valid values: {', '.join(choices)}.")
    return value


def _item_types(cls: type) -> dict[str, type]:
    """The list keys of a section whose entries are `Item`s: key -> entry type."""
    out = {}
    for key, tp in typing.get_type_hints(cls).items():
        args = typing.get_args(tp) if typing.get_origin(tp) is list else ()
        if args and isinstance(args[0], type) and issubclass(args[0], Item):
            out[key] = args[0]
    return out


def _item_from_dict(where: str, cls: type, data: Any) -> Any:
    """An entry of a list key (`Item`) from its mapping: the same strict rules as a section, plus required keys."""
    if isinstance(data, cls):
        return data
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = [name for name, f in fields.items() if f.metadata.get("required")]
    if not isinstance(data, dict):
        optional = [name for name in fields if name not in required]
        raise UserError(f"{where} must be a mapping with {' and '.join(required)}"
                        f"{' (and optionally ' + ', '.join(optional) + ')' if optional else ''}, got {data!r}.")
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise UserError(f"{where} has unknown keys {unknown}; valid: {', '.join(fields)}.")
    missing = [name for name in required if name not in data]
    if missing:
        raise UserError(f"{where} must give {' and '.join(required)}; it lacks {', '.join(missing)} ({data!r}).")
    hints = typing.get_type_hints(cls)
    item = cls(**{key: _coerce(f"{where}.{key}", value, hints[key], dict(fields[key].metadata))
                  for key, value in data.items()})
    item.validate(where)
    return item

