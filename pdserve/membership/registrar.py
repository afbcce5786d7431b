"""An instance's registration in etcd: its record under a lease, kept alive, restored, and given up on the way out.

The lease's TTL (10 s by default) bounds how long a crashed instance stays a member. Keep-alives go every third
of it, so one late keep-alive does not lose the lease. A lease etcd no longer knows (it expired while etcd was
away, or etcd was restored empty) is replaced by a new one and the record written again; so is a record that
went missing (checked at every relist period). While etcd does not answer, the instance keeps serving and keeps
trying. `leave` writes the record once more with the state that says why (draining, not_ready) so gateways drop
it at once and count the cause, then revokes the lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec

from pdserve.membership.discovery import DEFAULT_RELIST_S
from pdserve.membership.etcd_client import EtcdClient, EtcdError
from pdserve.membership.record import DRAINING, MemberRecord, encode_record, member_key

log = logging.getLogger(__name__)
DEFAULT_TTL_S = 10


class Registrar:
    def __init__(self, client: EtcdClient, prefix: str, record: Callable[[], MemberRecord],
                 ttl_s: int = DEFAULT_TTL_S, check_s: float = DEFAULT_RELIST_S) -> None:
        if ttl_s < 1:
            raise ValueError(f"--discovery-ttl must be at least 1 second, got {ttl_s}")
        self.client = client
        self.prefix = prefix
        self.record = record  # called at each (re)registration: what the instance says now
        self.ttl_s = ttl_s
        self.check_s = check_s
        self.lease = 0
        self._unreachable = False
        self._task: asyncio.Task | None = None

    def key(self) -> bytes:
        return member_key(self.prefix, self.record().url).encode()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        checked = time.monotonic()
        while True:
            try:
                if not self.lease:
                    await self._register()
                    checked = time.monotonic()
                elif await self.client.keep_alive(self.lease) <= 0:
                    log.warning("membership: etcd lost this instance's lease; registering again")
                    self.lease = 0
                    continue
                elif time.monotonic() - checked >= self.check_s:
                    await self._check()
                    checked = time.monotonic()
                self._reachable()
                await asyncio.sleep(self.ttl_s / 3)
            except EtcdError as exc:
                if not self._unreachable:
                    log.warning("membership: cannot reach etcd (%s); serving on and retrying", exc)
                    self._unreachable = True
                await asyncio.sleep(min(1.0, self.ttl_s / 3))

    def _reachable(self) -> None:
        if self._unreachable:
            log.info("membership: etcd answers again; registered under lease %x", self.lease)
            self._unreachable = False

    async def _register(self) -> None:
        lease = await self.client.grant(self.ttl_s)
        record = self.record()
        await self.client.put(self.key(), encode_record(record), lease)
        self.lease = lease
        log.info("membership: registered %s instance %s in etcd under %s (lease %x, TTL %d s)", record.role,
                 record.url, self.prefix, lease, self.ttl_s)

    async def _check(self) -> None:
        """Level-triggered on this side too: the record must be there, under this lease."""
        kvs, _ = await self.client.get_prefix(self.key())
        if not any(kv.key == self.key() and kv.lease == self.lease for kv in kvs):
            log.warning("membership: this instance's record was missing from etcd; writing it again")
            await self.client.put(self.key(), encode_record(self.record()), self.lease)

    async def leave(self, state: str = DRAINING, timeout_s: float = 2.0) -> None:
        """Stop keeping the registration, say why it ends, and revoke the lease (bounded: etcd may be down)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if not self.lease:
            return
        lease, self.lease = self.lease, 0
        try:
            async with asyncio.timeout(timeout_s):
                record = msgspec.structs.replace(self.record(), state=state)
                await self.client.put(self.key(), encode_record(record), lease)
                await self.client.revoke(lease)
            log.info("membership: left etcd (%s)", state)
        except (EtcdError, TimeoutError) as exc:
            log.warning("membership: could not leave etcd (%s); the lease ends within %d s", exc, self.ttl_s)

    async def close(self) -> None:
        await self.client.close()
