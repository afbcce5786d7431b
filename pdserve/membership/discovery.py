"""One discovery interface for the gateway, several backends: static, the admin `/register`, etcd, Kubernetes.

A backend reports the whole set of records it knows (a *view*, by key), never only a change: after its first
list, after every change it follows, and after a relist at least every `relist_s` seconds. The gateway's
`Membership` diffs each view against the last one, so a change a backend missed (a watch cut, events dropped)
is corrected by the next relist: membership is level-triggered. Whether a member gets traffic is the registry's
breaker (gateway/health.py); a backend says only who is in the fleet.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from typing import Protocol

from pdserve.membership.record import MemberRecord

log = logging.getLogger(__name__)

DEFAULT_RELIST_S = 30.0

# Why a member joined or left (the `cause` label of pdserve:gateway_membership_changes).
JOINED, LEFT, LEASE_EXPIRED, NOT_READY, RELIST_CORRECTION = (
    "joined", "left", "lease_expired", "not_ready", "relist_correction")


class View(Protocol):
    """What a backend reports to (the gateway's Membership)."""

    def replace(self, source: str, records: dict[str, MemberRecord], relist: bool,
                causes: dict[str, str] | None = None) -> None:
        """The whole set `source` knows now, by key; `relist`: it came from a full list, so a difference from
        the last view is something the backend's change feed missed. `causes`: why each removed key left."""

    def set_stale(self, source: str, why: str | None) -> None:
        """`why` the backend cannot reach its store (its view stays as it was), or None when it can again."""


class Discovery(ABC):
    """A membership backend. `run` follows the membership until it is cancelled."""

    name = ""

    def __init__(self, relist_s: float = DEFAULT_RELIST_S) -> None:
        if relist_s <= 0:
            raise ValueError(f"the relist period must be positive, got {relist_s}")
        self.relist_s = relist_s

    @abstractmethod
    async def run(self, view: View) -> None:
        """List, report, follow changes and relist every `relist_s` seconds, until cancelled. A store that cannot
        be reached is reported with `view.set_stale` and retried; it never ends the loop."""

    async def register(self, record: MemberRecord) -> None:
        """Write a record through to the backend's store (the admin `/register`); only stores that take writes."""
        raise NotImplementedError(f"the {self.name} backend takes no registrations")

    async def deregister(self, url: str) -> bool:
        raise NotImplementedError(f"the {self.name} backend takes no registrations")

    @property
    def writable(self) -> bool:
        return False

    async def close(self) -> None:
        """Release what `run` opened (connections); called after `run` was cancelled."""


class StaticDiscovery(Discovery):
    """Today's flags and config file: a fixed set, reported once and again at every relist. An operator's
    `/deregister` of a configured instance holds until the gateway restarts."""

    name = "static"

    def __init__(self, records: list[MemberRecord], relist_s: float = DEFAULT_RELIST_S) -> None:
        super().__init__(relist_s)
        self.records = {r.url: r for r in records}
        self._view: View | None = None

    async def run(self, view: View) -> None:
        self._view = view
        while True:
            view.replace(self.name, self.records, relist=True)
            await asyncio.sleep(self.relist_s)

    async def deregister(self, url: str) -> bool:
        if url not in self.records:
            return False
        self.records = {k: v for k, v in self.records.items() if k != url}
        self._report({url: LEFT})
        return True

    def _report(self, causes: dict[str, str] | None = None) -> None:
        if self._view is not None:
            self._view.replace(self.name, self.records, relist=False, causes=causes)


class PushDiscovery(StaticDiscovery):
    """Instances registered through the gateway's admin `POST /register`, when no store is configured: this
    gateway's own memory (a store makes `/register` write through to it instead, so every gateway sees it)."""

    name = "register"

    def __init__(self, relist_s: float = DEFAULT_RELIST_S) -> None:
        super().__init__([], relist_s)

    @property
    def writable(self) -> bool:
        return True

    async def register(self, record: MemberRecord) -> None:
        self.records = {**self.records, record.url: record}
        self._report()
