"""Small helpers shared across layers (engine, connectors, config). Imports nothing, torch least of all, so any
module — the torch-free gateway included — can use them without pulling in the engine."""

from __future__ import annotations

import os
from pathlib import Path


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


def pace_bytes_per_s(mib_per_s: object, what: str) -> float:
    """A pace given in MiB/s (a config value or a request field), in bytes per second; ValueError naming `what`
    unless it is a finite number >= 0."""
    if isinstance(mib_per_s, bool) or not isinstance(mib_per_s, int | float) or not 0 <= mib_per_s < float("inf"):
        raise ValueError(f"{what} must be a finite number >= 0 (MiB/s), got {mib_per_s!r}")
    return float(mib_per_s) * 2**20


def native_cache_dir() -> Path:
    """Where compiled native code is cached per machine: `PDSERVE_NATIVE_CACHE`, else the user's cache folder."""
    root = os.environ.get("PDSERVE_NATIVE_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve" / "native"
