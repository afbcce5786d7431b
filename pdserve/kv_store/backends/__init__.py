"""The stores the tier runs on: a registry by URL scheme, each imported only when used (Mooncake's module is
an optional install)."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.kv_store.backends.base import StoreBackend, StoreUnavailable
from pdserve.kv_store.config import StoreConfig

__all__ = ["STORE_BACKENDS", "StoreBackend", "StoreUnavailable", "make_backend"]


def _redis(config: StoreConfig) -> StoreBackend:
    from pdserve.kv_store.backends.redis_store import RedisBackend

    return RedisBackend(config)


def _mooncake(config: StoreConfig) -> StoreBackend:
    from pdserve.kv_store.backends.mooncake_store import MooncakeBackend

    return MooncakeBackend(config)


STORE_BACKENDS: dict[str, Callable[[StoreConfig], StoreBackend]] = {"redis": _redis, "mooncake": _mooncake}


def make_backend(config: StoreConfig) -> StoreBackend:
    return STORE_BACKENDS[config.scheme](config)
