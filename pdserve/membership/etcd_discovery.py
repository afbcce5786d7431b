"""The gateway's etcd backend: list the prefix, watch it from the list's revision, relist every `relist_s`.

A watch that breaks, a compacted revision or an etcd that does not answer sends the loop back to a full list,
retried every `retry_s` until etcd answers; meanwhile the view stays as it was (the gateway keeps serving its
members) and is marked stale. The first list after etcd comes back replaces the view whole, so what happened
while it was away (instances gone, come, re-registered) is caught up at once.

A record under the prefix that cannot be read is skipped with one warning naming its key (once per version of
it); it never ends the loop or empties the view.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.membership.discovery import DEFAULT_RELIST_S, LEASE_EXPIRED, LEFT, Discovery, View
from pdserve.membership.etcd_client import EtcdClient, EtcdError, KeyValue, WatchCompacted, WatchEvent
from pdserve.membership.record import (MemberRecord, RecordError, decode_record, encode_record, member_key,
                                       members_prefix)

log = logging.getLogger(__name__)


class EtcdDiscovery(Discovery):
    name = "etcd"

    def __init__(self, client: EtcdClient, prefix: str, relist_s: float = DEFAULT_RELIST_S,
                 retry_s: float = 0.2) -> None:
        super().__init__(relist_s)
        self.client = client
        self.prefix = prefix
        self.retry_s = retry_s
        self.records: dict[str, MemberRecord] = {}
        self._view: View | None = None
        self._warned: set[tuple[bytes, int]] = set()

    async def run(self, view: View) -> None:
        self._view = view
        while True:
            try:
                revision = await self._list(view)
                view.set_stale(self.name, None)
                await self._follow(view, revision)
            except WatchCompacted as exc:
                log.info("membership: etcd watch %s; listing again", exc)
            except EtcdError as exc:
                view.set_stale(self.name, str(exc))
                await asyncio.sleep(self.retry_s)

    async def _list(self, view: View) -> int:
        kvs, revision = await self.client.get_prefix(members_prefix(self.prefix).encode())
        records = {}
        for kv in kvs:
            record = self._read(kv)
            if record is not None:
                records[kv.key.decode(errors="replace")] = record
        self.records = records
        view.replace(self.name, records, relist=True)
        return revision

    async def _follow(self, view: View, revision: int) -> None:
        """Apply changes until the next relist is due (then return) or the watch fails (then raise)."""
        try:
            async with asyncio.timeout(self.relist_s):
                async for batch in self.client.watch_prefix(members_prefix(self.prefix).encode(), revision + 1):
                    self._apply(view, batch)
        except TimeoutError:
            return  # the relist is due

    def _apply(self, view: View, batch: list[WatchEvent]) -> None:
        if not batch:
            return
        records = dict(self.records)
        causes: dict[str, str] = {}
        for event in batch:
            key = event.kv.key.decode(errors="replace")
            record = self._read(event.kv) if event.kind == "put" else None
            if record is None:
                previous = records.pop(key, None)
                if previous is not None:
                    # A key that goes while its record said ready, and had a lease, went with that lease: the
                    # instance stopped keeping it alive. One without a lease was deleted (deregistered).
                    lease = event.prev.lease if event.prev is not None else 0
                    causes[key] = LEASE_EXPIRED if event.kind == "delete" and lease else LEFT
            else:
                records[key] = record
        self.records = records
        view.replace(self.name, records, relist=False, causes=causes)

    def _read(self, kv: KeyValue) -> MemberRecord | None:
        try:
            return decode_record(kv.value)
        except RecordError as exc:
            if (kv.key, kv.mod_revision) not in self._warned:
                self._warned.add((kv.key, kv.mod_revision))
                log.warning("membership: skipping the record at etcd key %s: %s",
                            kv.key.decode(errors="replace"), exc)
            return None

    # -- the admin /register writes through ----------------------------------------------------------------
    @property
    def writable(self) -> bool:
        return True

    async def register(self, record: MemberRecord) -> None:
        """A registration every gateway sees: a key without a lease, there until `/deregister` (whether the
        instance is fit for traffic is each gateway's health check)."""
        key = member_key(self.prefix, record.url)
        await self.client.put(key.encode(), encode_record(record))
        self._local(key, record)

    async def deregister(self, url: str) -> bool:
        key = member_key(self.prefix, url)
        removed = await self.client.delete(key.encode()) > 0
        self._local(key, None)
        return removed

    def _local(self, key: str, record: MemberRecord | None) -> None:
        """Apply an admin write to this gateway's view at once; the watch brings the same change right after."""
        records = {k: v for k, v in self.records.items() if k != key}
        if record is not None:
            records[key] = record
        self.records = records
        if self._view is not None:
            self._view.replace(self.name, records, relist=False, causes={key: LEFT})

    async def close(self) -> None:
        await self.client.close()
