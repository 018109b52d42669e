"""The config reference: every key with its type, default, bounds and doc, read from the schema's fields; the one
source of `largebatch config` and docs/config.md (largebatch/commands/config.py)."""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import Any

from largebatch.config.fields import _item_types, _type_name
from largebatch.config.schema import SECTIONS


@dataclass(frozen=True)
class KeyDoc:
    """One config key as `largebatch config` and docs/config.md show it, read from its dataclass field."""

    key: str          # section.key, or section.key[].field for an entry of a list key
    type: str
    default: str
    bounds: str       # choices, sign or range; "" when any value of the type goes
    doc: str


def shown(value: Any) -> str:
    """A setting's value as a user would write it after --set (lists and mappings as YAML flow, i.e. JSON)."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bounds(meta: Any) -> str:
    if meta.get("choices"):
        return ", ".join(meta["choices"])
    return meta.get("bounds", "")


def reference() -> list[KeyDoc]:
    """Every config key in section order, from the dataclasses (type, default, bounds, doc), the entries of a
    list key (a phase) after it: the one source of `largebatch config` and docs/config.md."""
    rows = []

    def add(prefix: str, cls: type, instance: Any) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}"
            default = None if f.metadata.get("required") else getattr(instance, f.name, f.default)
            shown_default = "required" if f.metadata.get("required") else shown(default) if default is not None else "null"
            item = _item_types(cls).get(f.name)
            type_name = f"list of {item.__name__}" if item else _type_name(hints[f.name])
            for word in f.metadata.get("words", ()):   # a word a number key also takes ("auto")
                type_name = type_name.replace(" or null", f", {word} or null")
            rows.append(KeyDoc(key, type_name, shown_default, _bounds(f.metadata), f.metadata.get("doc", "")))
            if item is not None:
                add(f"{key}[]", item, None)

    for name, cls in SECTIONS.items():
        add(name, cls, cls())
    return rows
