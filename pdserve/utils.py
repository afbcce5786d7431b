"""Small helpers shared across layers (engine, connectors, config). Imports nothing, torch least of all, so any
module — the torch-free gateway included — can use them without pulling in the engine."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of `b` tokens hold `a` tokens."""
    return -(-a // b)
