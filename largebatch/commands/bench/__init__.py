"""Benchmarks (`largebatch bench ...`); `machine()` names the machine every figure was taken on."""
from __future__ import annotations

from largebatch.metrics import FLAGS_OF_NOTE, machine

__all__ = ["FLAGS_OF_NOTE", "machine"]
