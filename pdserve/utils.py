"""Small helpers shared across layers (engine, connectors, config). Imports nothing, torch least of all, so any
module — the torch-free gateway included — can use them without pulling in the engine."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of `b` tokens hold `a` tokens."""
    return -(-a // b)


def cpuinfo_line(*prefixes: str) -> str | None:
    """The first line of /proc/cpuinfo that starts with one of `prefixes`, as read; None where there is none (or no
    /proc/cpuinfo: not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            return next((line for line in info if line.startswith(prefixes)), None)
    except OSError:
        return None
