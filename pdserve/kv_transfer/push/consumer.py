"""D's side of push: register blocks with a producer, let only its writes in, and wait for its write-done.

The blocks stay D's to fill until P's write-done (or a failure notice) arrives, or the registration's deadline
passes; if D's request ends first, it asks P to stop and still waits for P's last word (or a short grace).

With `push_quarantine` on, a registration D gave up on without P's last word is quarantined: P may be writing into
its blocks at that very moment (a one-sided write cannot be called back), so they are neither recomputed in nor
freed until P says it stopped, until its process is gone (its side channel refuses connections), or until a write
let in before D gave up has surely ended (`IN_FLIGHT_BOUND_S` after the last one D let in; after D gave up, where
P writes without asking, as over shared memory); no late write lands in blocks D has reused. The request waits
with its blocks (up to a minute when P is cut off), which is why it is off by default: then D recomputes at once
and a write of a P that outlived D's deadline can, rarely, land in the recomputed blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from pdserve.ids import ReqId, TransferId
from pdserve.kv_transfer.data_plane import DataPlaneError
from pdserve.kv_transfer.data_plane.base import IN_FLIGHT_BOUND_S
from pdserve.kv_transfer.integrity import invalid_blocks
from pdserve.kv_transfer.messages import Ack, PushRegister, Release, WriteDone
from pdserve.kv_transfer.peers import Peers
from pdserve.kv_transfer.push.specs import PushRegistration
from pdserve.kv_transfer.runtime import AgentRuntime, LoadResult

log = logging.getLogger(__name__)

# After giving up on a push, how long to wait for the producer's last word before reusing the blocks.
_GIVE_UP_GRACE_S = 2.0


@dataclass(slots=True)
class PushExpectation:
    """Blocks registered with a producer, waiting for its writes and write-done."""

    request_id: ReqId
    transfer_id: TransferId
    token: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    deadline: float
    started_at: float
    cancelled: bool = False
    plane: str = ""  # the data plane P writes over, once the handshake chose it
    settle_by: float | None = None  # quarantined (D gave up, P has not said it stopped) until then
    last_write: float | None = None  # when D last let one of P's writes in


class PushConsumer:
    """Owns the registrations. Thread-safe entry points for the engine thread; the work runs on the loop."""

    def __init__(self, rt: AgentRuntime, peers: Peers) -> None:
        self.rt = rt
        self.peers = peers
        self._lock = threading.Lock()
        self._expected: dict[TransferId, PushExpectation] = {}
        self._completed: list[LoadResult] = []

    # -- engine thread -------------------------------------------------------------------------------------
    def expect(self, r: PushRegistration, timeout_s: float) -> None:
        """Register our blocks with the producer; they are freed if its write-done is not in by `timeout_s`."""
        now = time.monotonic()
        expectation = PushExpectation(r.request_id, r.transfer_id, r.token, tuple(r.block_ids), r.host, r.port,
                                      now + timeout_s, now)
        register = PushRegister(transfer_id=r.transfer_id, block_ids=list(r.block_ids), first_block=r.first_block,
                                num_tokens=r.num_tokens, consumer_engine_id=self.rt.config.engine_id,
                                consumer_host=self.rt.config.host, consumer_port=self.rt.port, token=r.token,
                                prompt_hash=r.prompt_hash)
        with self._lock:
            self._expected[expectation.transfer_id] = expectation
        self.rt.call(self._register(expectation, register))

    def cancel(self, transfer_id: TransferId) -> None:
        """The request ended: ask the producer to stop; blocks stay ours until its write-done."""
        with self._lock:
            expectation = self._expected.get(transfer_id)
            if expectation is None:
                return
            expectation.cancelled = True
        self.rt.call(self.peers.release(expectation.host, expectation.port, transfer_id, expectation.token,
                                        "consumer ended"))

    def give_up(self, transfer_id: TransferId) -> bool:
        """The gateway says this push will not come (its prefill leg failed); compute locally soon.

        Our blocks are reused only after P's write-done, or a short grace if P is gone, so no late write can
        land in KV we recompute.
        """
        with self._lock:
            expectation = self._expected.get(transfer_id)
            if expectation is None:
                return False
            expectation.cancelled = True
            expectation.deadline = min(expectation.deadline, time.monotonic() + _GIVE_UP_GRACE_S)
        self.rt.call(self.peers.release(expectation.host, expectation.port, transfer_id, expectation.token,
                                        "prefill leg failed"))
        return True

    def take_completed(self) -> list[LoadResult]:
        with self._lock:
            out, self._completed = self._completed, []
        return out

    def num_expected(self) -> int:
        with self._lock:
            return len(self._expected)

    # -- the agent's loop ----------------------------------------------------------------------------------
    def authorize_write(self, key: str, token: str, block_ids: list[int]) -> str | None:
        """A producer may write only into the blocks registered for its transfer, with its token."""
        with self._lock:
            expectation = self._expected.get(TransferId(key))
            if expectation is None or expectation.cancelled:
                return f"no registration for transfer {key!r}"
            if token != expectation.token:
                return f"wrong transfer token for {key!r}"
            if not set(block_ids) <= set(expectation.block_ids):
                return f"blocks outside the registration of {key!r}"
            expectation.last_write = time.monotonic()
        return None

    async def _register(self, expectation: PushExpectation, register: PushRegister) -> None:
        try:
            peer = await self.peers.peer(expectation.host, expectation.port, None)  # the producer must be compatible
            expectation.plane = peer.plane
            reply = await self.peers.request(expectation.host, expectation.port, register)
            if not isinstance(reply, Ack) or not reply.ok:
                raise DataPlaneError(getattr(reply, "error", "") or "the producer refused the registration")
        except Exception as exc:  # noqa: BLE001 - any failure must end the push, never strand the request
            self._complete(expectation.transfer_id, ok=False, error=f"registration failed: {exc}")

    async def on_write_done(self, message: WriteDone) -> Ack:
        with self._lock:
            expectation = self._expected.get(message.transfer_id)
        if expectation is None:
            return Ack(ok=False, error=f"no registration for transfer {message.transfer_id!r}")
        if message.token != expectation.token:
            return Ack(ok=False, error=f"wrong transfer token for {message.transfer_id!r}")
        invalid: list[int] = []
        if message.ok:
            invalid = await self.rt.off_loop(invalid_blocks, self.rt.regions, list(expectation.block_ids),
                                             message.checksums)
            self.rt.stats.blocks_invalid += len(invalid)
        self._complete(message.transfer_id, message.ok, message.error, invalid, fatal=message.refusal == "denied",
                       mismatch=message.refusal == "prompt_mismatch")
        return Ack(ok=True)

    def _complete(self, transfer_id: TransferId, ok: bool, error: str = "", invalid: list[int] | None = None,
                  fatal: bool = False, mismatch: bool = False) -> None:
        with self._lock:
            expectation = self._expected.pop(transfer_id, None)
            if expectation is None:
                return
            if expectation.settle_by is not None:
                self.rt.stats.blocks_quarantined -= len(expectation.block_ids)
            ok = ok and not expectation.cancelled
            # P wrote every registered block when its write-done says ok
            block_bytes = self.rt.regions.block_bytes
            self._completed.append(LoadResult(
                expectation.request_id, ok=ok, error=error, fatal=fatal and not ok, mismatch=mismatch and not ok,
                invalid_blocks=list(invalid or ()) if ok else [], plane=expectation.plane,
                started_at=expectation.started_at, seconds=time.monotonic() - expectation.started_at,
                nbytes=len(expectation.block_ids) * block_bytes if ok else 0))
        if ok:
            self.rt.stats.push_done_ok += 1
        else:
            self.rt.stats.push_done_failed += 1
            log.warning("push transfer %s ended without the KV: %s", transfer_id, error or "cancelled")
        self.rt.on_event()

    async def watch(self) -> None:
        """Forever: give up on registrations whose producer did not finish in time (quarantined, and it is told
        to stop), and end quarantines whose bound passed with no word from the producer."""
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            with self._lock:
                late = [e for e in self._expected.values() if e.deadline <= now and e.settle_by is None]
                settled = [e for e in self._expected.values() if e.settle_by is not None and e.settle_by <= now]
            for expectation in settled:
                log.warning("push transfer %s: no word from its producer, but no write of its can still be "
                            "moving; its blocks are reused", expectation.transfer_id)
                self._complete(expectation.transfer_id, ok=False,
                               error=f"no write-done within {self.rt.config.push_timeout_s} s")
            for expectation in late:
                self._quarantine(expectation, now)

    def _quarantine(self, expectation: PushExpectation, now: float) -> None:
        """Stop waiting for the producer, but keep the blocks until it says nothing more will land (or no write
        D let in can still be moving)."""
        self.rt.stats.push_registration_timeouts += 1
        plane = self.rt.config.planes.get(expectation.plane)
        unseen = plane is None or not plane.authorizes_writes  # P may have started a write just now
        last_write = now if unseen else expectation.last_write
        with self._lock:
            expectation.cancelled = True  # no further write is let in
            guarded = self.rt.config.push_quarantine and last_write is not None
            if guarded and last_write + IN_FLIGHT_BOUND_S > now:
                expectation.settle_by = last_write + IN_FLIGHT_BOUND_S
                self.rt.stats.blocks_quarantined += len(expectation.block_ids)
                asyncio.create_task(self._stop_producer(expectation))
                return
        asyncio.create_task(self.peers.release(expectation.host, expectation.port, expectation.transfer_id,
                                               expectation.token, "registration timed out"))
        self._complete(expectation.transfer_id, ok=False,
                       error=f"no write-done within {self.rt.config.push_timeout_s} s")

    async def _stop_producer(self, expectation: PushExpectation) -> None:
        """Release the transfer until the producer answers (it answers once none of its writes can land any
        more), then end the quarantine; `watch` ends it at its bound if no answer comes."""
        release = Release(key=expectation.transfer_id, token=expectation.token, reason="registration timed out")
        while expectation.transfer_id in self._expected:
            try:
                reply = await self.peers.request(expectation.host, expectation.port, release)
            except Exception as exc:  # noqa: BLE001 - asked again (a lost message); the bound covers a dead peer
                if await _process_gone(expectation.host, expectation.port):
                    # Its writes were its own process's copies (a memcpy, a kernel copy, a socket): they died
                    # with it, so nothing more can land.
                    self._complete(expectation.transfer_id, ok=False, error="the producer's process is gone")
                    return
                log.debug("release of %s not answered (%s); asking again", expectation.transfer_id, exc)
                await asyncio.sleep(0.5)
                continue
            if isinstance(reply, Ack) and reply.ok:
                self._complete(expectation.transfer_id, ok=False,
                               error=f"no write-done within {self.rt.config.push_timeout_s} s")
            return


async def _process_gone(host: str, port: int) -> bool:
    """Whether the producer's side channel refuses connections: its process is gone (a live one, however slow or
    cut off, accepts or does not answer at all)."""
    try:
        # asyncio.timeout, not wait_for: wait_for wraps the connect in a task, which a loop stopping at shutdown
        # leaves never awaited (a warning at every shutdown that caught one in flight).
        async with asyncio.timeout(1.0):
            _, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        return True
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return False
