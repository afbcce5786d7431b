"""The transfer agent: an instance's cross-instance work, on its own asyncio thread.

Producer side: leases on held blocks (renewed by heartbeats, ended by read-done, release or expiry) and the
checks that guard every read. Consumer side: handshakes (compatibility hash, engine id), loads with deadlines,
heartbeats for the transfers it still needs, and releases when it gives up. The engine thread talks to it only
through the thread-safe methods at the top; results come back through ``take_*``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq.asyncio

from pdserve.ids import ReqId
from pdserve.kv_transfer.data_plane import DataPlane, DataPlaneError, PeerChannel
from pdserve.kv_transfer.data_plane.shm import host_identity
from pdserve.kv_transfer.faults import FaultConfig, FaultInjector, InjectedFault
from pdserve.kv_transfer.integrity import block_checksums, invalid_blocks
from pdserve.kv_transfer.messages import (Ack, Handshake, HandshakeReply, Heartbeat, Message, PushRegister, ReadDone,
                                          ReadGrant, ReadGrantReply, Release, WriteDone)
from pdserve.kv_transfer.side_channel import SideChannelClient, SideChannelError, SideChannelServer

log = logging.getLogger(__name__)

# How long a read-done that beat its hold registration is remembered.
_EARLY_NOTICE_TTL_S = 60.0


# How many ended holds are remembered, to tell a late reader "expired" rather than "never granted".
_ENDED_MEMORY = 65536

# After giving up on a push, how long to wait for the producer's last word before reusing the blocks.
_PUSH_GIVE_UP_GRACE_S = 2.0


def _by_transfer(transfer_id: str) -> str:
    """Early-notice key for a release that named a transfer_id rather than a hold key."""
    return f"transfer:{transfer_id}"


def _log_failure(future: Any) -> None:
    """Background coroutines handle their own errors; one that escapes is a bug worth a traceback."""
    if not future.cancelled() and future.exception() is not None:
        log.error("KV agent task failed", exc_info=future.exception())


@dataclass(slots=True)
class Lease:
    key: str
    token: str
    block_ids: frozenset[int]
    expires_at: float
    transfer_id: str | None = None


@dataclass(frozen=True, slots=True)
class LoadJob:
    request_id: ReqId
    host: str
    port: int
    engine_id: str
    key: str
    token: str
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    deadline_s: float


@dataclass(slots=True)
class LoadResult:
    request_id: ReqId
    ok: bool
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    invalid_blocks: list[int] = field(default_factory=list)  # local blocks that arrived damaged
    fatal: bool = False  # refused as never granted: the request must fail whatever the policy


class TransferRefused(DataPlaneError):
    def __init__(self, message: str, refusal: str) -> None:
        super().__init__(message)
        self.refusal = refusal


@dataclass(slots=True)
class PushExpectation:
    """Consumer side: blocks registered with a producer, waiting for its writes and write-done."""

    request_id: ReqId
    transfer_id: str
    token: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    deadline: float
    cancelled: bool = False


@dataclass(slots=True)
class _Peer:
    """A handshaken producer: its identity and an open data channel."""

    engine_id: str
    channel: PeerChannel
    plane: str


@dataclass(slots=True)
class AgentStats:
    bytes_received: int = 0
    bytes_sent: int = 0
    loads_ok: int = 0
    loads_failed: int = 0
    leases_expired: int = 0
    releases_received: int = 0
    read_done_received: int = 0
    load_seconds_total: float = 0.0
    handshake_refusals: int = 0
    reads_denied: int = 0
    blocks_invalid: int = 0
    push_writes: int = 0
    push_bytes_sent: int = 0
    push_done_ok: int = 0
    push_done_failed: int = 0
    push_registration_timeouts: int = 0


@dataclass(slots=True)
class AgentConfig:
    engine_id: str
    compat_hash: str
    host: str = "127.0.0.1"
    port: int = 0
    lease_s: float = 30.0
    handshake_timeout_s: float = 5.0
    message_timeout_s: float = 10.0
    load_timeout_s: float = 60.0
    hold_wait_s: float = 2.0
    push_timeout_s: float = 60.0  # D frees a registration P has not fulfilled by then
    capture_path: str | None = None  # append every side-channel message here (drills, tests)
    preferred_plane: str = "auto"  # "auto" picks shm when the peer shares this host
    planes: dict[str, DataPlane] = field(default_factory=dict)
    faults: FaultConfig = field(default_factory=FaultConfig)


class TransferAgent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.stats = AgentStats()
        self.faults = FaultInjector(config.faults)
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._released: set[str] = set()
        self._early_notices: dict[str, float] = {}
        self._transfers: dict[str, str] = {}  # transfer_id -> key, for holds made on a gateway's behalf
        self._ended: OrderedDict[str, None] = OrderedDict()  # recently ended holds: "expired", not "never granted"
        self._registrations: list[PushRegister] = []  # producer: arrived, not yet taken by the worker
        self._push_releases: dict[str, str] = {}  # producer: transfer_id -> token, transfers the consumer gave up on
        self._expected: dict[str, PushExpectation] = {}  # consumer: transfer_id -> expectation
        # One writer thread: a transfer's writes land in the order they were issued (catch-up before layers).
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-push-writer")
        self._capture_file = open(config.capture_path, "a") if config.capture_path else None  # noqa: SIM115
        self._completed: list[LoadResult] = []
        self._heartbeats: dict[tuple[str, int], set[str]] = {}
        self._clients: dict[tuple[str, int], SideChannelClient] = {}
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._peer_locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdserve-transfer")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.on_event: Callable[[], None] = lambda: None  # wakes the engine loop when a transfer event lands
        self._tasks: list[asyncio.Task] = []
        self._server: SideChannelServer | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self.port = 0

    # == thread-safe API (engine thread) ==================================================================
    def start(self) -> None:
        for plane in self.config.planes.values():
            plane.start(self._authorize)
        self._thread = threading.Thread(target=self._run_loop, name="pdserve-agent", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the transfer agent did not start")

    def stop(self) -> None:
        if self._loop is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        for plane in self.config.planes.values():
            plane.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.writer.shutdown(wait=False, cancel_futures=True)
        if self._capture_file is not None:
            self._capture_file.close()

    def hold(self, key: str, token: str, block_ids: list[int], transfer_id: str | None = None) -> None:
        """Producer: keep these blocks for a consumer until read-done, release or lease expiry."""
        with self._lock:
            early = self._early_notices.pop(key, None)
            if transfer_id is not None:
                early = self._early_notices.pop(_by_transfer(transfer_id), early)
            if early is not None:  # the release beat the hold: free at once
                self._released.add(key)
                return
            self._leases[key] = Lease(key, token, frozenset(block_ids), time.monotonic() + self.config.lease_s,
                                      transfer_id)
            if transfer_id is not None:
                self._transfers[transfer_id] = key

    def release_local(self, key: str | None, token: str, transfer_id: str | None) -> bool:
        """Producer: free a held transfer on its client's (or gateway's) request. Thread-safe.

        By key and token, or by the gateway's transfer_id (it knows no key if P's answer never reached it).
        A release that arrives before the hold is remembered and applied when the hold registers.
        """
        if transfer_id is not None and self._give_up_push(transfer_id):
            return True
        with self._lock:
            if key is None and transfer_id is not None:
                key = self._transfers.get(transfer_id)
                if key is None:
                    self._early_notices[_by_transfer(transfer_id)] = time.monotonic()
                    return False
        if key is None:
            return False
        self.stats.releases_received += 1
        return self._end_lease(key, token).ok

    def take_released(self) -> set[str]:
        with self._lock:
            out, self._released = self._released, set()
        return out

    def submit_load(self, job: LoadJob) -> None:
        self._call(self._load(job))

    def take_completed(self) -> list[LoadResult]:
        with self._lock:
            out, self._completed = self._completed, []
        return out

    def watch(self, host: str, port: int, key: str) -> None:
        """Consumer: send heartbeats for this transfer until `unwatch`."""
        with self._lock:
            self._heartbeats.setdefault((host, port), set()).add(key)

    def unwatch(self, host: str, port: int, key: str) -> None:
        with self._lock:
            keys = self._heartbeats.get((host, port))
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._heartbeats[(host, port)]

    def send_release(self, host: str, port: int, key: str, token: str, reason: str) -> None:
        """Consumer: tell the producer to free a transfer's blocks now (fire and forget, with a deadline)."""
        self._call(self._release(host, port, key, token, reason))

    def set_faults(self, config: FaultConfig) -> None:
        """Replace the fault injector (a drill switch). Readers take the reference once, so this is atomic."""
        self.faults = FaultInjector(config)
        if self._server is not None:
            self._server.sender.faults = self.faults
        for client in list(self._clients.values()):
            client.sender.faults = self.faults

    def num_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    # -- push, producer side (thread-safe; the worker half calls these) ----------------------------------
    def take_registrations(self) -> list[PushRegister]:
        with self._lock:
            out, self._registrations = self._registrations, []
        return out

    def has_push_work(self) -> bool:
        with self._lock:
            return bool(self._registrations or self._push_releases)

    def take_push_releases(self) -> dict[str, str]:
        with self._lock:
            out, self._push_releases = self._push_releases, {}
        return out

    def write_blocks(self, registration: PushRegister, local_ids: list[int], remote_ids: list[int],
                     layer: int | None) -> None:
        """On the writer thread: copy blocks (or one layer of them) into the consumer's registered blocks."""
        stall = self.faults.before_transfer("write")
        if stall:
            time.sleep(stall)
        peer = asyncio.run_coroutine_threadsafe(
            self.peer(registration.consumer_host, registration.consumer_port, registration.consumer_engine_id),
            self._loop).result(self.config.handshake_timeout_s + 1)
        lost = self.faults.lost_blocks(local_ids) if self.faults.enabled else set()
        pairs = [(s, d) for s, d in zip(local_ids, remote_ids, strict=True) if s not in lost]
        if not pairs:
            return
        local_ids, remote_ids = [s for s, _ in pairs], [d for _, d in pairs]
        self.stats.push_bytes_sent += peer.channel.write_blocks(registration.transfer_id, registration.token,
                                                                local_ids, remote_ids, layer)
        self.stats.push_writes += 1

    def send_write_done(self, registration: PushRegister, ok: bool, error: str = "",
                        source_blocks: list[int] | None = None, refusal: str = "") -> None:
        """Tell the consumer its blocks are complete (or will not be). Called after the writes, in order.

        With `source_blocks` (ours, in registration order), the message carries their checksums.
        """
        checksums = block_checksums(self.pool, source_blocks) if ok and source_blocks else []
        message = WriteDone(transfer_id=registration.transfer_id, token=registration.token, ok=ok, error=error,
                            checksums=checksums, refusal=refusal)
        self._call(self._notify(registration.consumer_host, registration.consumer_port, message))

    async def _notify(self, host: str, port: int, message: Message) -> None:
        try:
            await self.client(host, port).request(message, self.config.message_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the receiver's deadline covers an undelivered notice
            log.warning("could not deliver %s to %s:%d: %s", type(message).__name__, host, port, exc)

    # -- push, consumer side -----------------------------------------------------------------------------
    def expect_push(self, expectation: PushExpectation, register: PushRegister) -> None:
        with self._lock:
            self._expected[expectation.transfer_id] = expectation
        self._call(self._register_push(expectation, register))

    async def _register_push(self, expectation: PushExpectation, register: PushRegister) -> None:
        try:
            await self.peer(expectation.host, expectation.port, None)  # the producer must be compatible
            reply = await self.client(expectation.host, expectation.port).request(register,
                                                                                  self.config.message_timeout_s)
            if not isinstance(reply, Ack) or not reply.ok:
                raise DataPlaneError(getattr(reply, "error", "") or "the producer refused the registration")
        except Exception as exc:  # noqa: BLE001 - any failure must end the push, never strand the request
            self._complete_push(expectation.transfer_id, ok=False, error=f"registration failed: {exc}")

    def cancel_push(self, transfer_id: str) -> None:
        """The consumer's request ended: ask the producer to stop; blocks stay ours until its write-done."""
        with self._lock:
            expectation = self._expected.get(transfer_id)
            if expectation is None:
                return
            expectation.cancelled = True
        self._call(self._release(expectation.host, expectation.port, transfer_id, expectation.token, "consumer ended"))

    def _give_up_push(self, transfer_id: str) -> bool:
        """Consumer: the gateway says this push will not come (its prefill leg failed); compute locally soon.

        Our blocks are reused only after P's write-done, or a short grace if P is gone, so no late write can
        land in KV we recompute.
        """
        with self._lock:
            expectation = self._expected.get(transfer_id)
            if expectation is None:
                return False
            expectation.cancelled = True
            expectation.deadline = min(expectation.deadline, time.monotonic() + _PUSH_GIVE_UP_GRACE_S)
        self._call(self._release(expectation.host, expectation.port, transfer_id, expectation.token,
                                 "prefill leg failed"))
        return True

    async def _push_done(self, message: WriteDone) -> Ack:
        with self._lock:
            expectation = self._expected.get(message.transfer_id)
        if expectation is None:
            return Ack(ok=False, error=f"no registration for transfer {message.transfer_id!r}")
        if message.token != expectation.token:
            return Ack(ok=False, error=f"wrong transfer token for {message.transfer_id!r}")
        invalid: list[int] = []
        if message.ok:
            invalid = await asyncio.get_running_loop().run_in_executor(
                self._executor, invalid_blocks, self.pool, list(expectation.block_ids), message.checksums)
            self.stats.blocks_invalid += len(invalid)
        self._complete_push(message.transfer_id, message.ok, message.error, invalid, fatal=message.refusal == "denied")
        return Ack(ok=True)

    def _complete_push(self, transfer_id: str, ok: bool, error: str = "", invalid: list[int] | None = None,
                       fatal: bool = False) -> None:
        with self._lock:
            expectation = self._expected.pop(transfer_id, None)
            if expectation is None:
                return
            ok = ok and not expectation.cancelled
            self._completed.append(LoadResult(expectation.request_id, ok=ok, error=error, fatal=fatal and not ok,
                                              invalid_blocks=list(invalid or ()) if ok else []))
        if ok:
            self.stats.push_done_ok += 1
        else:
            self.stats.push_done_failed += 1
            log.warning("push transfer %s ended without the KV: %s", transfer_id, error or "cancelled")
        self.on_event()

    async def _watch_pushes(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            with self._lock:
                late = [e for e in self._expected.values() if e.deadline <= now]
            for expectation in late:
                self.stats.push_registration_timeouts += 1
                self._complete_push(expectation.transfer_id, ok=False,
                                    error=f"no write-done within {self.config.push_timeout_s} s")
                asyncio.create_task(self._release(expectation.host, expectation.port, expectation.transfer_id,
                                                  expectation.token, "registration timed out"))

    def num_expected(self) -> int:
        with self._lock:
            return len(self._expected)

    # -- capture -----------------------------------------------------------------------------------------
    def _capture(self, direction: str, message: Message) -> None:
        if self._capture_file is not None:
            record = {"time": time.time(), "engine_id": self.config.engine_id, "direction": direction,
                      "message": msgspec.to_builtins(message), "type": type(message).__name__}
            self._capture_file.write(json.dumps(record) + "\n")
            self._capture_file.flush()

    def _call(self, coro: Any) -> None:
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(coro, self._loop).add_done_callback(_log_failure)

    # == the agent thread =================================================================================
    def _run_loop(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._ctx = zmq.asyncio.Context()
        self._server = SideChannelServer(self._ctx, self.config.host, self.config.port, self._handle, self.faults,
                                         self._capture)
        self.port = self._server.port
        self._tasks = [loop.create_task(self._server.serve()), loop.create_task(self._reap_leases()),
                       loop.create_task(self._send_heartbeats()), loop.create_task(self._watch_pushes())]
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for address in list(self._peers):
            self._drop_peer(address)
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        if self._server is not None:
            self._server.close()
        if self._ctx is not None:
            self._ctx.term()

    # -- producer: requests from consumers ----------------------------------------------------------------
    async def _handle(self, message: Message) -> Message:
        if isinstance(message, Handshake):
            return self._handshake(message)
        if isinstance(message, ReadGrant):
            return await self._grant(message)
        if isinstance(message, ReadDone):
            self.stats.read_done_received += 1
            return self._end_lease(message.key, message.token)
        if isinstance(message, Release):
            self.stats.releases_received += 1
            with self._lock:
                is_hold = message.key in self._leases
                if not is_hold:
                    self._push_releases[message.key] = message.token  # maybe a push transfer: the worker checks
            self.on_event()
            return self._end_lease(message.key, message.token) if is_hold else Ack(ok=True)
        if isinstance(message, PushRegister):
            with self._lock:
                self._registrations.append(message)
            self.on_event()
            return Ack(ok=True)
        if isinstance(message, WriteDone):
            return await self._push_done(message)
        if isinstance(message, Heartbeat):
            return self._renew(message.keys)
        return await self.handle_extra(message)

    async def handle_extra(self, message: Message) -> Message:
        """Messages of other transfer modes (push, decode-first); connectors extend this."""
        return Ack(ok=False, error=f"unsupported message {type(message).__name__}")

    def _handshake(self, message: Handshake) -> HandshakeReply:
        info = {name: plane.local_info() for name, plane in self.config.planes.items()}
        ok = message.compat_hash == self.config.compat_hash
        if not ok:
            self.stats.handshake_refusals += 1
        return HandshakeReply(ok=ok, engine_id=self.config.engine_id, compat_hash=self.config.compat_hash,
                              data_plane=",".join(self.config.planes), data_plane_info=info,
                              error="" if ok else "incompatible instances: model, dtype, KV layout, block size or "
                                                  "protocol version differ (compatibility hash mismatch)")

    def _authorize(self, op: str, key: str, token: str, block_ids: list[int]) -> str | None:
        """The capability check every read passes: right transfer, right token, only its own blocks."""
        if op != "read":
            return self.authorize_write(key, token, block_ids)
        with self._lock:
            lease = self._leases.get(key)
            if lease is None:
                return f"no KV is held for transfer {key!r} (unknown, released or expired)"
            if token != lease.token:
                return f"wrong transfer token for {key!r}"
            if not set(block_ids) <= lease.block_ids:
                return f"blocks outside transfer {key!r} were requested"
            # A granted read must not lose its blocks mid-copy.
            lease.expires_at = max(lease.expires_at, time.monotonic() + self.config.lease_s)
        return None

    async def _grant(self, message: ReadGrant) -> ReadGrantReply:
        await self._await_hold(message.key)
        refusal = self._authorize("read", message.key, message.token, message.block_ids)
        if refusal is not None:
            with self._lock:
                expired = message.key in self._ended
            if not expired:
                self.stats.reads_denied += 1
            return ReadGrantReply(ok=False, error=refusal, refusal="expired" if expired else "denied")
        checksums = await asyncio.get_running_loop().run_in_executor(
            self._executor, block_checksums, self.pool, list(message.block_ids))
        return ReadGrantReply(ok=True, checksums=checksums)

    @property
    def pool(self):
        """The local KV pool (every data plane serves the same one)."""
        return next(iter(self.config.planes.values())).kv

    async def _await_hold(self, key: str) -> None:
        """P answers its client a moment before its engine thread registers the hold; a fast consumer may
        ask in between, so give the hold a short, bounded time to appear."""
        deadline = time.monotonic() + self.config.hold_wait_s
        while time.monotonic() < deadline:
            with self._lock:
                if key in self._leases or key in self._released:
                    return
            await asyncio.sleep(0.001)

    def authorize_write(self, key: str, token: str, block_ids: list[int]) -> str | None:
        """Consumer: a producer may write only into the blocks registered for its transfer, with its token."""
        with self._lock:
            expectation = self._expected.get(key)
            if expectation is None or expectation.cancelled:
                return f"no registration for transfer {key!r}"
            if token != expectation.token:
                return f"wrong transfer token for {key!r}"
            if not set(block_ids) <= set(expectation.block_ids):
                return f"blocks outside the registration of {key!r}"
        return None

    def _end_lease(self, key: str, token: str) -> Ack:
        with self._lock:
            lease = self._leases.get(key)
            if lease is None:
                self._early_notices[key] = time.monotonic()
                return Ack(ok=True)
            if token != lease.token:
                return Ack(ok=False, error=f"wrong transfer token for {key!r}")
            self._drop_lease(key)
        self.on_event()
        return Ack(ok=True)

    def _drop_lease(self, key: str) -> None:
        """Callers hold the lock."""
        self._ended[key] = None
        while len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)
        lease = self._leases.pop(key)
        if lease.transfer_id is not None:
            self._transfers.pop(lease.transfer_id, None)
        self._released.add(key)

    def _renew(self, keys: list[str]) -> Ack:
        now = time.monotonic()
        unknown = []
        with self._lock:
            for key in keys:
                lease = self._leases.get(key)
                if lease is None:
                    unknown.append(key)
                else:
                    lease.expires_at = max(lease.expires_at, now + self.config.lease_s * 2 / 3)
        return Ack(ok=True, unknown_keys=unknown)

    async def _reap_leases(self) -> None:
        interval = max(0.02, min(1.0, self.config.lease_s / 20))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            with self._lock:
                expired = [k for k, lease in self._leases.items() if lease.expires_at <= now]
                for key in expired:
                    self._drop_lease(key)
                self.stats.leases_expired += len(expired)
                stale = [k for k, t in self._early_notices.items() if now - t > _EARLY_NOTICE_TTL_S]
                for key in stale:
                    del self._early_notices[key]
            for key in expired:
                log.warning("lease of transfer %s expired; its blocks are freed", key)
            if expired:
                self.on_event()

    # -- consumer ------------------------------------------------------------------------------------------
    async def peer(self, host: str, port: int, expected_engine_id: str | None) -> _Peer:
        """A handshaken connection to the producer at host:port, refreshed if its engine id changed."""
        address = (host, port)
        lock = self._peer_locks.setdefault(address, asyncio.Lock())
        async with lock:
            peer = self._peers.get(address)
            if peer is not None and expected_engine_id not in (None, peer.engine_id):
                self._drop_peer(address)  # the producer restarted: never read from its predecessor
                peer = None
            if peer is None:
                peer = await self._handshake_with(host, port)
                self._peers[address] = peer
            if expected_engine_id not in (None, peer.engine_id):
                raise TransferRefused(f"the instance at {host}:{port} is engine {peer.engine_id}, not "
                                      f"{expected_engine_id} named by the transfer parameters", "denied")
            return peer

    def client(self, host: str, port: int) -> SideChannelClient:
        """The control connection to a peer; messages on it need no handshake (a release must always get through)."""
        address = (host, port)
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = SideChannelClient(self._ctx, host, port, self.faults, self._capture)
        return client

    async def _handshake_with(self, host: str, port: int) -> _Peer:
        reply = await self.client(host, port).request(
            Handshake(engine_id=self.config.engine_id, compat_hash=self.config.compat_hash),
            self.config.handshake_timeout_s)
        if not isinstance(reply, HandshakeReply):
            raise DataPlaneError(f"unexpected handshake reply from {host}:{port}: {reply}")
        if not reply.ok or reply.compat_hash != self.config.compat_hash:
            raise DataPlaneError(reply.error or "compatibility hash mismatch")
        plane_name = self._choose_plane(reply.data_plane_info)
        channel = await asyncio.get_running_loop().run_in_executor(
            self._executor, self.config.planes[plane_name].connect, reply.data_plane_info[plane_name])
        return _Peer(reply.engine_id, channel, plane_name)

    def _choose_plane(self, offered: dict[str, Any]) -> str:
        preferred = self.config.preferred_plane
        if preferred != "auto":
            if preferred not in offered or preferred not in self.config.planes:
                raise DataPlaneError(f"the peer does not offer the {preferred} data plane")
            return preferred
        same_host = offered.get("shm", {}).get("host_id") == host_identity()
        if same_host and "shm" in self.config.planes:
            return "shm"
        if "tcp" in offered and "tcp" in self.config.planes:
            return "tcp"
        raise DataPlaneError("no data plane in common with the peer")

    def _drop_peer(self, address: tuple[str, int]) -> None:
        """Forget a peer's data channel after a failure: the next load handshakes afresh.

        The control connection stays: ZeroMQ reconnects it by itself, and other transfers' heartbeats, releases
        and loads are waiting on it; closing it would fail them all for one peer's slow answer.
        """
        peer = self._peers.pop(address, None)
        if peer is not None:
            peer.channel.close()

    async def _load(self, job: LoadJob) -> None:
        started = time.monotonic()
        try:
            nbytes, invalid = await asyncio.wait_for(self._read(job), job.deadline_s)
        except Exception as exc:  # noqa: BLE001 - any failure must fail this load, never strand the request
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            expected = (DataPlaneError, SideChannelError, OSError, TimeoutError, ConnectionError, InjectedFault)
            log.log(logging.WARNING if isinstance(exc, expected) else logging.ERROR,
                    "KV load for %s from %s:%d failed: %s", job.request_id, job.host, job.port, error,
                    exc_info=not isinstance(exc, expected))
            self.stats.loads_failed += 1
            fatal = isinstance(exc, TransferRefused) and exc.refusal == "denied"
            self._finish_load(job, LoadResult(job.request_id, ok=False, error=error, fatal=fatal))
            if isinstance(exc, (SideChannelError, ConnectionError, OSError)):
                self._drop_peer((job.host, job.port))
            await self._release(job.host, job.port, job.key, job.token, "load failed")
            return
        seconds = time.monotonic() - started
        self.stats.loads_ok += 1
        self.stats.bytes_received += nbytes
        self.stats.load_seconds_total += seconds
        self.stats.blocks_invalid += len(invalid)
        if invalid:
            log.warning("KV load for %s: %d of %d blocks failed their checksum", job.request_id, len(invalid),
                        len(job.local_block_ids))
        # The bytes are in place: let the request run now, and tell P afterwards.
        self._finish_load(job, LoadResult(job.request_id, ok=True, nbytes=nbytes, seconds=seconds,
                                          invalid_blocks=invalid))
        try:
            done = await self.client(job.host, job.port).request(ReadDone(key=job.key, token=job.token),
                                                                 self.config.message_timeout_s)
            if isinstance(done, Ack) and not done.ok:
                log.warning("producer did not accept read-done for %s: %s", job.key, done.error)
        except Exception as exc:  # noqa: BLE001 - the load is done; P's lease covers a lost read-done
            log.warning("read-done for %s not delivered (%s); P's lease will expire", job.key, exc)

    def _finish_load(self, job: LoadJob, result: LoadResult) -> None:
        self.unwatch(job.host, job.port, job.key)
        with self._lock:
            self._completed.append(result)
        self.on_event()

    async def _read(self, job: LoadJob) -> tuple[int, list[int]]:
        """Copy the granted blocks; returns (bytes, local blocks whose checksum did not match)."""
        peer = await self.peer(job.host, job.port, job.engine_id)
        grant = await self.client(job.host, job.port).request(
            ReadGrant(key=job.key, token=job.token, block_ids=list(job.remote_block_ids)), self.config.message_timeout_s)
        if not isinstance(grant, ReadGrantReply):
            raise DataPlaneError(getattr(grant, "error", "") or "unexpected answer to a read grant")
        if not grant.ok:
            raise TransferRefused(grant.error or "the producer refused the read", grant.refusal or "denied")
        stall = self.faults.before_transfer("read")
        if stall:
            await asyncio.sleep(stall)
        loop = asyncio.get_running_loop()
        local = list(job.local_block_ids)
        nbytes = await loop.run_in_executor(self._executor, peer.channel.read_blocks, job.key, job.token,
                                            list(job.remote_block_ids), local)
        if self.faults.enabled:
            self.faults.damage(self.pool, local, self.faults.lost_blocks(local))
        invalid = await loop.run_in_executor(self._executor, invalid_blocks, self.pool, local, grant.checksums)
        return nbytes, invalid

    async def _release(self, host: str, port: int, key: str, token: str, reason: str) -> None:
        try:
            await self.client(host, port).request(Release(key=key, token=token, reason=reason),
                                                  self.config.message_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a release is best effort: the lease is the backstop
            log.warning("could not release %s at %s:%d (%s); its lease will expire", key, host, port, exc)

    async def _send_heartbeats(self) -> None:
        interval = max(0.05, self.config.lease_s / 6)
        while True:
            await asyncio.sleep(interval)
            with self._lock:
                targets = {address: sorted(keys) for address, keys in self._heartbeats.items() if keys}
            for (host, port), keys in targets.items():
                try:
                    await self.client(host, port).request(Heartbeat(keys=keys), self.config.message_timeout_s)
                except Exception as exc:  # noqa: BLE001 - one peer's failure must not stop the others' heartbeats
                    log.warning("heartbeat to %s:%d failed: %s", host, port, exc)
