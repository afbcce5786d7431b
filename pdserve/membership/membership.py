"""The gateway's membership: the views of its discovery backends, reconciled into its registry.

Every backend reports whole views (discovery.py); an instance is a member while some backend lists a ready
record for its URL (the first backend in order wins when two do). Each report is diffed against the members
before it: joins and leaves go to the registry, each with one log line and a count by cause. Nothing here runs
per request: the registry's instances are what requests read, and they change only when membership does.

A backend that cannot reach its store keeps its last view (the gateway serves the members it has), says so in a
gauge and one log line, and catches up with a full list as soon as the store answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pdserve.membership.discovery import JOINED, LEFT, NOT_READY, RELIST_CORRECTION, Discovery
from pdserve.membership.record import DRAINING, MemberRecord

log = logging.getLogger(__name__)
_LEFT_BY_STATE = {DRAINING: LEFT, NOT_READY: NOT_READY}


class Membership:
    def __init__(self, sources: list[Discovery], join: Callable[[MemberRecord], object],
                 leave: Callable[[str], object]) -> None:
        """`join(record)` adds or updates a member in the registry, `leave(url)` removes it."""
        self.sources = sources
        self._join, self._leave = join, leave
        self.views: dict[str, dict[str, MemberRecord]] = {}
        self.members: dict[str, MemberRecord] = {}  # by URL: what the registry holds
        self.stale: dict[str, str] = {}  # source -> why its store cannot be reached
        self.changes: dict[str, int] = {}  # by cause
        self._pending: dict[str, str] = {}  # url -> why it left, until the reconcile applies it
        self._reported: dict[str, asyncio.Event] = {s.name: asyncio.Event() for s in sources}
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def start(self, first_list_s: float = 5.0) -> None:
        """Start every backend and wait (bounded) for each one's first view, so a gateway starts with its fleet."""
        self._tasks = [asyncio.create_task(self._run(s)) for s in self.sources]
        waits = [asyncio.create_task(e.wait()) for e in self._reported.values()]
        if waits:
            done, pending = await asyncio.wait(waits, timeout=first_list_s)
            for task in pending:
                task.cancel()
            if pending:
                late = [n for n, e in self._reported.items() if not e.is_set()]
                log.warning("membership: no first list from %s within %g s; starting with what the others listed",
                            ", ".join(late), first_list_s)

    async def _run(self, source: Discovery) -> None:
        try:
            await source.run(self)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in a backend must not take the gateway's membership with it silently
            log.exception("membership: the %s backend stopped", source.name)
            raise

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for source in self.sources:
            await source.close()

    # -- admin registrations (write through to the first store that takes them) -----------------------------
    @property
    def store(self) -> Discovery | None:
        return next((s for s in self.sources if s.writable), None)

    async def register(self, record: MemberRecord) -> None:
        store = self.store
        if store is None:
            raise ValueError("no discovery backend here takes registrations")
        await store.register(record)

    async def deregister(self, url: str) -> bool:
        """Remove `url` from every backend that can forget it (the flags' list too, until a restart)."""
        removed = False
        for source in self.sources:
            try:
                removed = await source.deregister(url.rstrip("/")) or removed
            except NotImplementedError:
                continue
        return removed

    # -- the View the backends report to --------------------------------------------------------------------
    def replace(self, source: str, records: dict[str, MemberRecord], relist: bool,
                causes: dict[str, str] | None = None) -> None:
        first = source not in self.views
        before = self.views.get(source, {})
        self.views[source] = dict(records)
        for key, old in before.items():
            new = records.get(key)
            if old.ready and (new is None or not new.ready):
                cause = causes.get(key) if causes else None
                if new is not None:
                    cause = _LEFT_BY_STATE.get(new.state, LEFT)
                self._pending[old.url] = RELIST_CORRECTION if relist and not first else (cause or LEFT)
        self._reconcile(correcting=relist and not first)
        if source in self._reported:
            self._reported[source].set()

    def set_stale(self, source: str, why: str | None) -> None:
        if why is None:
            if self.stale.pop(source, None) is not None:
                log.info("membership: the %s store answers again; following it", source)
        elif source not in self.stale:
            self.stale[source] = why
            log.warning("membership: cannot reach the %s store (%s); serving the %d members known until it "
                        "answers", source, why, len(self.members))
        else:
            self.stale[source] = why

    # -- the registry follows ---------------------------------------------------------------------------------
    def _wanted(self) -> dict[str, MemberRecord]:
        wanted: dict[str, MemberRecord] = {}
        for source in self.sources:
            for record in self.views.get(source.name, {}).values():
                if record.ready and record.url not in wanted:
                    wanted[record.url] = record
        return wanted

    def _reconcile(self, correcting: bool) -> None:
        wanted = self._wanted()
        for url in [u for u in self.members if u not in wanted]:
            cause = self._pending.pop(url, RELIST_CORRECTION if correcting else LEFT)
            record = self.members.pop(url)
            self._leave(url)
            self._count(cause)
            log.info("membership: %s %s instance %s left (%s)", record.source or "a", record.role, url, cause)
        self._pending.clear()
        for url, record in wanted.items():
            old = self.members.get(url)
            if old == record:
                continue
            self.members[url] = record
            self._join(record)
            if old is None:
                cause = RELIST_CORRECTION if correcting else JOINED
                self._count(cause)
                log.info("membership: %s instance %s joined (%s%s%s)", record.role, url, cause,
                         f", model {record.model}" if record.model else "",
                         f", from {record.source}" if record.source else "")
            else:
                log.info("membership: %s instance %s updated its record", record.role, url)

    def _count(self, cause: str) -> None:
        self.changes[cause] = self.changes.get(cause, 0) + 1
