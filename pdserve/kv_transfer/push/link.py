"""P's end of push on the agent: what arrives from consumers, and the writes and notices that go back.

Registrations and releases arrive on the agent's loop and wait here until the engine thread's
``PushProducer`` takes them at its next step. Writes go out on one writer thread, so a transfer's writes land
in the order they were issued (catch-up before layers) and its write-done follows the last of them. A consumer
whose cache is laid out by another engine (pdserve's pool and vLLM-CPU's caches) gets our blocks regrouped into
its layout in a staging area on that thread, and checksums of those staged bytes, which are what its blocks hold.
A release is answered only once no write of its transfer can land any more: the writer skips a released transfer
from the moment the release arrives, and a write already moving is waited out; so the answer lets the consumer
reuse the blocks it gave up on.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from pdserve.ids import TransferId
from pdserve.kv_transfer.data_plane import DataPlaneError
from pdserve.kv_transfer.integrity import block_checksums
from pdserve.kv_transfer.messages import Ack, PushRegister, WriteDone
from pdserve.kv_transfer.peers import Peer, Peers
from pdserve.kv_transfer.runtime import AgentRuntime

# Released transfers the writer must skip, remembered for as long as writes for them may still be queued: a
# bounded number, far more than are ever in flight.
_STOPPED_REMEMBERED = 4096


class ProducerLink:
    def __init__(self, rt: AgentRuntime, peers: Peers) -> None:
        self.rt = rt
        self.peers = peers
        self._lock = threading.Lock()
        self._registrations: list[PushRegister] = []  # arrived, not yet taken by the engine thread
        self._releases: dict[TransferId, str] = {}  # transfer_id -> token, transfers the consumer gave up on
        self._stopped: OrderedDict[TransferId, str] = OrderedDict()  # the same, for the writer to skip
        self._writing = threading.Lock()  # held while the writer moves bytes
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-push-writer")

    # -- the agent's loop ----------------------------------------------------------------------------------
    async def on_register(self, message: PushRegister) -> Ack:
        with self._lock:
            self._registrations.append(message)
        self.rt.on_event()
        return Ack(ok=True)

    async def on_release(self, key: str, token: str) -> None:
        """A release for no lease may be a push transfer's: the producer checks at its next step, the writer at
        once; returns when a write already moving has ended."""
        with self._lock:
            self._releases[TransferId(key)] = token
            self._stopped[TransferId(key)] = token
            while len(self._stopped) > _STOPPED_REMEMBERED:
                self._stopped.popitem(last=False)
        await self.rt.off_loop(self._wait_for_writer)

    def _wait_for_writer(self) -> None:
        with self._writing:
            pass

    # -- engine thread -------------------------------------------------------------------------------------
    def take_registrations(self) -> list[PushRegister]:
        with self._lock:
            out, self._registrations = self._registrations, []
        return out

    def take_releases(self) -> dict[TransferId, str]:
        with self._lock:
            out, self._releases = self._releases, {}
        return out

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._registrations or self._releases)

    # -- writer thread -------------------------------------------------------------------------------------
    def write_blocks(self, registration: PushRegister, local_ids: list[int], remote_ids: list[int],
                     layer: int | None) -> None:
        """Copy blocks (or one layer of them) into the consumer's registered blocks."""
        faults = self.rt.faults
        stall = faults.before_transfer("write")
        if stall:
            time.sleep(stall)
        peer = self._peer(registration)
        lost = faults.lost_blocks(local_ids) if faults.enabled else set()
        pairs = [(s, d) for s, d in zip(local_ids, remote_ids, strict=True) if s not in lost]
        if not pairs:
            return
        local_ids, remote_ids = [s for s, _ in pairs], [d for _, d in pairs]
        key, token = registration.transfer_id, registration.token
        with self._writing:
            with self._lock:
                released = self._stopped.get(key) == token
            if released:
                raise DataPlaneError("released by the consumer")
            if peer.regrouper is None:
                nbytes = peer.channel.write_blocks(key, token, local_ids, remote_ids, layer)
            else:
                _, staging = peer.regrouper.ungroup(self.rt.caches, local_ids, layer)
                nbytes = peer.channel.write_from(key, token, list(range(len(local_ids))), remote_ids, staging, layer)
            self.rt.stats.push_bytes_sent += nbytes
        self.rt.stats.push_writes += 1

    def _peer(self, registration: PushRegister) -> Peer:
        return self.rt.call_and_wait(
            self.peers.peer(registration.consumer_host, registration.consumer_port, registration.consumer_engine_id),
            self.rt.config.handshake_timeout_s + 1)

    def _checksums(self, registration: PushRegister, source_blocks: list[int]) -> list[int]:
        """Of the bytes the consumer's blocks hold once written: ours, or ours staged in its layout."""
        peer = self._peer(registration)
        if peer.regrouper is None:
            return block_checksums(self.rt.regions, source_blocks)
        _, staging = peer.regrouper.ungroup(self.rt.caches, source_blocks, None)
        return block_checksums(staging, list(range(len(source_blocks))))

    def send_write_done(self, registration: PushRegister, ok: bool, error: str = "",
                        source_blocks: list[int] | None = None, refusal: str = "") -> None:
        """Tell the consumer its blocks are complete (or will not be). Called after the writes, in order.

        With `source_blocks` (ours, in registration order), the message carries their checksums.
        """
        checksums: list[int] = []
        if ok and source_blocks:
            try:
                checksums = self._checksums(registration, source_blocks)
            except Exception as exc:  # noqa: BLE001 - the consumer must still hear that its blocks are not usable
                ok, error = False, f"could not checksum the written blocks: {exc}"
        message = WriteDone(transfer_id=registration.transfer_id, token=registration.token, ok=ok, error=error,
                            checksums=checksums, refusal=refusal)
        self.rt.call(self.peers.notify(registration.consumer_host, registration.consumer_port, message))

    def close(self) -> None:
        self.writer.shutdown(wait=False, cancel_futures=True)
