"""The producer side of pull: leases on held blocks, the grants that guard every read, and their endings.

P holds a finished prefill's blocks under a lease (key, random token, block ids). A consumer's heartbeats
renew it; read-done, a release or expiry end it, and the blocks go back to the engine through
``take_released``. A release may beat the hold it ends (the engine thread registers holds a moment after P
answered): it is remembered for a while as an early notice and applied when the hold arrives.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from pdserve.ids import TransferId
from pdserve.kv_transfer.integrity import block_checksums
from pdserve.kv_transfer.messages import Ack, Heartbeat, ReadDone, ReadGrant, ReadGrantReply
from pdserve.kv_transfer.runtime import AgentRuntime

log = logging.getLogger(__name__)

# How long a read-done that beat its hold registration is remembered.
_EARLY_NOTICE_TTL_S = 60.0

# How many ended holds are remembered, to tell a late reader "expired" rather than "never granted".
_ENDED_MEMORY = 65536


def _by_transfer(transfer_id: TransferId) -> str:
    """Early-notice key for a release that named a transfer_id rather than a hold key."""
    return f"transfer:{transfer_id}"


@dataclass(slots=True)
class Lease:
    key: str
    token: str
    block_ids: frozenset[int]
    expires_at: float
    transfer_id: TransferId | None = None
    vllm: bool = False  # mirror blocks a vLLM decoder reads with NIXL: never granted on pdserve's planes


class PullProducer:
    """Owns the leases. Thread-safe: the engine thread holds, the agent's loop grants, renews and ends."""

    def __init__(self, rt: AgentRuntime) -> None:
        self.rt = rt
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._released: set[str] = set()
        self._early_notices: dict[str, float] = {}
        self._transfers: dict[TransferId, str] = {}  # transfer_id -> key, for holds made on a gateway's behalf
        self._ended: OrderedDict[str, None] = OrderedDict()  # recently ended holds: "expired", not "never granted"

    # -- engine thread -------------------------------------------------------------------------------------
    def hold(self, key: str, token: str, block_ids: list[int], transfer_id: TransferId | None = None,
             vllm: bool = False) -> None:
        """Keep these blocks for a consumer until read-done, release or lease expiry."""
        with self._lock:
            early = self._early_notices.pop(key, None)
            if transfer_id is not None:
                early = self._early_notices.pop(_by_transfer(transfer_id), early)
            if early is not None:  # the release beat the hold: free at once
                self._released.add(key)
                return
            self._leases[key] = Lease(key, token, frozenset(block_ids), time.monotonic() + self.rt.config.lease_s,
                                      transfer_id, vllm)
            if transfer_id is not None:
                self._transfers[transfer_id] = key

    def release(self, key: str | None, token: str, transfer_id: TransferId | None) -> bool:
        """Free a held transfer by key and token, or by the gateway's transfer_id (it knows no key if P's
        answer never reached it). A release that arrives before the hold is applied when the hold registers."""
        with self._lock:
            if key is None and transfer_id is not None:
                key = self._transfers.get(transfer_id)
                if key is None:
                    self._early_notices[_by_transfer(transfer_id)] = time.monotonic()
                    return False
        if key is None:
            return False
        self.rt.stats.releases_received += 1
        ack = self.end_released(key, token)
        return ack.ok and not ack.unknown_keys

    def take_released(self) -> set[str]:
        with self._lock:
            out, self._released = self._released, set()
        return out

    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def release_all(self) -> int:
        """End every hold now: an instance that drains frees what no consumer came for in time."""
        with self._lock:
            keys = list(self._leases)
            for key in keys:
                self._drop(key)
        if keys:
            self.rt.on_event()
        return len(keys)

    def is_held(self, key: str) -> bool:
        with self._lock:
            return key in self._leases

    # -- the agent's loop ----------------------------------------------------------------------------------
    def authorize_read(self, key: str, token: str, block_ids: list[int]) -> str | None:
        """The capability check every read passes: right transfer, right token, only its own blocks."""
        with self._lock:
            lease = self._leases.get(key)
            if lease is None:
                return f"no KV is held for transfer {key!r} (unknown, released or expired)"
            if lease.vllm or token != lease.token:
                return f"wrong transfer token for {key!r}"
            if not set(block_ids) <= lease.block_ids:
                return f"blocks outside transfer {key!r} were requested"
            # A granted read must not lose its blocks mid-copy.
            lease.expires_at = max(lease.expires_at, time.monotonic() + self.rt.config.lease_s)
        return None

    async def on_read_grant(self, message: ReadGrant) -> ReadGrantReply:
        await self._await_hold(message.key)
        refusal = self.authorize_read(message.key, message.token, message.block_ids)
        if refusal is not None:
            with self._lock:
                expired = message.key in self._ended
            if not expired:
                self.rt.stats.reads_denied += 1
            return ReadGrantReply(ok=False, error=refusal, refusal="expired" if expired else "denied")
        checksums = await self.rt.off_loop(block_checksums, self.rt.regions, list(message.block_ids))
        return ReadGrantReply(ok=True, checksums=checksums)

    async def _await_hold(self, key: str) -> None:
        """P answers its client a moment before its engine thread registers the hold; a fast consumer may
        ask in between, so give the hold a short, bounded time to appear."""
        deadline = time.monotonic() + self.rt.config.hold_wait_s
        while time.monotonic() < deadline:
            with self._lock:
                if key in self._leases or key in self._released:
                    return
            await asyncio.sleep(0.001)

    async def on_read_done(self, message: ReadDone) -> Ack:
        self.rt.stats.read_done_received += 1
        return self.end(message.key, message.token)

    async def on_heartbeat(self, message: Heartbeat) -> Ack:
        return Ack(ok=True, unknown_keys=self.renew(message.keys))

    def renew(self, keys: list[str]) -> list[str]:
        """A consumer still wants these: extend their leases. Returns the keys that are not held."""
        now = time.monotonic()
        unknown = []
        with self._lock:
            for key in keys:
                lease = self._leases.get(key)
                if lease is None:
                    unknown.append(key)
                else:
                    lease.expires_at = max(lease.expires_at, now + self.rt.config.lease_s * 2 / 3)
        return unknown

    def end_notified(self, key: str) -> None:
        """vLLM's read-done notification (it carries no token; only a vLLM hold ends by it)."""
        with self._lock:
            lease = self._leases.get(key)
            if lease is not None and not lease.vllm:
                return
        self.rt.stats.read_done_received += 1
        self.end(key, lease.token if lease is not None else "")

    def end_released(self, key: str, token: str) -> Ack:
        """A Release message: end the hold it names. One that had already ended (read, released or expired) is
        acknowledged with its key in `unknown_keys`, so the sender can tell a release made from nothing held."""
        with self._lock:
            over = key in self._ended
        ack = self.end(key, token)
        return Ack(ok=True, unknown_keys=[key]) if ack.ok and over else ack

    def end(self, key: str, token: str) -> Ack:
        """End a lease (read-done or release); unknown keys are remembered in case the hold is yet to come."""
        with self._lock:
            lease = self._leases.get(key)
            if lease is None:
                self._early_notices[key] = time.monotonic()
                return Ack(ok=True)
            if token != lease.token:
                return Ack(ok=False, error=f"wrong transfer token for {key!r}")
            self._drop(key)
        self.rt.on_event()
        return Ack(ok=True)

    def _drop(self, key: str) -> None:
        """Callers hold the lock."""
        self._ended[key] = None
        while len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)
        lease = self._leases.pop(key)
        if lease.transfer_id is not None:
            self._transfers.pop(lease.transfer_id, None)
        self._released.add(key)

    async def reap(self) -> None:
        """Forever: free the blocks of leases nobody renewed, and forget stale early notices."""
        interval = max(0.02, min(1.0, self.rt.config.lease_s / 20))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            with self._lock:
                expired = [k for k, lease in self._leases.items() if lease.expires_at <= now]
                for key in expired:
                    self._drop(key)
                self.rt.stats.leases_expired += len(expired)
                stale = [k for k, t in self._early_notices.items() if now - t > _EARLY_NOTICE_TTL_S]
                for key in stale:
                    del self._early_notices[key]
            for key in expired:
                log.warning("lease of transfer %s expired; its blocks are freed", key)
            if expired:
                self.rt.on_event()
