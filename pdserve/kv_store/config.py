"""`kv_store` in a kv_transfer_config: which store, and how this instance uses it.

    "kv_store": {"url": "redis://127.0.0.1:6379/0" | "mooncake://127.0.0.1:50051", "capacity": "1GiB", "ttl": 3600}

pdserve instances read it at the top of `--kv-transfer-config`; inside vLLM it sits in
`kv_connector_extra_config` (vLLM's config takes no other keys). Refused whole when a key is unknown or a value
wrong: a misspelt key would otherwise be ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

SCHEMES = ("redis", "mooncake")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
KEYS = frozenset({"url", "capacity", "ttl", "lookup_timeout", "load_timeout", "write_queue_bytes", "retry_after",
                  "local_buffer"})


@dataclass(frozen=True, slots=True)
class StoreConfig:
    url: str
    # Memory this instance adds to the store: Mooncake's global segment (0: it only reads and writes, the
    # segments of `mooncake_client` processes or other instances hold the objects). A Redis server owns all
    # of its memory (its maxmemory and eviction policy), so there it must stay 0.
    capacity: int = 0
    ttl_s: float | None = None  # an entry older than this is a miss (Redis also expires it itself)
    lookup_timeout_s: float = 1.0  # a request waits this long for its lookup, then prefills without the store
    load_timeout_s: float = 10.0
    write_queue_bytes: int = 256 << 20  # staged blocks awaiting their write; past it a write is dropped
    retry_after_s: float = 5.0  # after a failed call, the store is left alone this long (then tried again)
    local_buffer: int = 64 << 20  # Mooncake's client transfer buffer

    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme


def parse_size(value: Any, what: str) -> int:
    """Bytes, as an integer or a string with a unit ("64MiB", "1GB")."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = re.fullmatch(r"\s*(\d+)\s*([kmg]i?b|b)?\s*", str(value).lower()) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"kv_store.{what} must be a byte count (an integer, or a string like '256MiB'), "
                         f"got {value!r}")
    return int(match.group(1)) * _UNITS[match.group(2) or ""]


def _seconds(raw: dict[str, Any], key: str, default: float | None) -> float | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"kv_store.{key} must be a positive number of seconds, got {value!r}")
    return float(value)


def store_config(raw: Any) -> StoreConfig | None:
    """The parsed `kv_store` entry (None when absent)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("kv_store must be an object like {\"url\": \"redis://127.0.0.1:6379/0\"}")
    unknown = set(raw) - KEYS
    if unknown:
        raise ValueError(f"unknown kv_store keys {sorted(unknown)}; known: {sorted(KEYS)}")
    url = raw.get("url")
    if not isinstance(url, str) or urlsplit(url).scheme not in SCHEMES or not urlsplit(url).hostname:
        raise ValueError(f"kv_store.url must be redis://HOST:PORT[/DB] or mooncake://MASTER_HOST:PORT, got {url!r}")
    capacity = parse_size(raw.get("capacity", 0), "capacity")
    if capacity and urlsplit(url).scheme == "redis":
        raise ValueError("kv_store.capacity applies to mooncake:// stores; a Redis server is sized by its own "
                         "maxmemory (with an allkeys-lru policy to evict)")
    defaults = StoreConfig(url)
    return StoreConfig(
        url=url, capacity=capacity, ttl_s=_seconds(raw, "ttl", None),
        lookup_timeout_s=_seconds(raw, "lookup_timeout", defaults.lookup_timeout_s) or 0.0,
        load_timeout_s=_seconds(raw, "load_timeout", defaults.load_timeout_s) or 0.0,
        write_queue_bytes=parse_size(raw.get("write_queue_bytes", defaults.write_queue_bytes), "write_queue_bytes"),
        retry_after_s=_seconds(raw, "retry_after", defaults.retry_after_s) or 0.0,
        local_buffer=parse_size(raw.get("local_buffer", defaults.local_buffer), "local_buffer"))
