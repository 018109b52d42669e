"""YAML a user hands over (recipes, --set values, a run's config.yaml, the measured catalog), loaded with a
bound on alias expansion.

PyYAML's safe loader runs no code, but anchors and aliases let a 0.7 KB document stand for 10^9 values
(a "billion laughs"), which it builds in memory before any key is checked. So:

1. Compose the document into nodes: an alias is the very node its anchor names, so composing costs the
   text's size, never the expansion's.
2. Count the values the document expands to, once per node (memoised), stopping at `MAX_VALUES`; a node
   that contains itself (a recursive alias) expands without end.
3. Only then construct the Python values, with the caller's loader class.
"""
from __future__ import annotations

from typing import Any

import yaml

MAX_VALUES = 100_000   # a recipe holds a few hundred; a study's table a few thousand


class TooLarge(ValueError):
    """The document expands beyond MAX_VALUES (or without end); the message says which."""


def _expanded(node: yaml.Node, memo: dict[int, int], busy: set[int], limit: int) -> int:
    key = id(node)
    if key in memo:
        return memo[key]
    if key in busy:
        raise TooLarge("an alias that refers to itself (it expands without end)")
    busy.add(key)
    total = 1
    if isinstance(node, yaml.SequenceNode):
        for child in node.value:
            total += _expanded(child, memo, busy, limit)
            if total > limit:
                break
    elif isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            total += _expanded(k, memo, busy, limit) + _expanded(v, memo, busy, limit)
            if total > limit:
                break
    busy.discard(key)
    if total > limit:
        raise TooLarge(f"more than {limit:,} values through its aliases (*name)")
    memo[key] = total
    return total


def load(text: str, loader: type = yaml.SafeLoader, limit: int = MAX_VALUES) -> Any:
    """Steps 1-3: the document in `text`, built by `loader` (a yaml.SafeLoader subclass). Raises
    yaml.YAMLError for bad syntax and TooLarge for a document that expands past `limit` values."""
    parser = loader(text)
    try:
        node = parser.get_single_node()
        if node is None:
            return None
        _expanded(node, {}, set(), limit)
        return parser.construct_document(node)
    finally:
        parser.dispose()
