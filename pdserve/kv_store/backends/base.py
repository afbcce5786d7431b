"""The store behind the tier: a key-value service holding whole stored blocks.

Every call may block on the network, so the tier makes them only on its own threads, never on the engine's, and
bounds each by a deadline of its own (`tier.py`). A backend raises `StoreUnavailable` when the store could not be
reached or failed the call; a value it does not have is None, not an error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pdserve.kv_store.config import StoreConfig


class StoreUnavailable(RuntimeError):
    """The store could not be reached, or failed a call."""


class StoreBackend(ABC):
    name = ""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config

    @abstractmethod
    def connect(self) -> None:
        """Reach the store (called again after a failure, when the tier retries)."""

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def get(self, keys: list[str]) -> list[bytes | None]: ...

    @abstractmethod
    def put(self, items: list[tuple[str, bytes]], ttl_s: float | None) -> list[bool]:
        """Store the values; returns which ones the store took (a full store may refuse some)."""

    @abstractmethod
    def remove(self, keys: list[str]) -> None: ...

    @abstractmethod
    def close(self) -> None: ...
