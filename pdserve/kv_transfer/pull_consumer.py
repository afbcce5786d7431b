"""The consumer side of pull: loads with deadlines, read-done, heartbeats and releases.

D reads a producer's held blocks over the data plane after a read grant (which also brings their checksums),
then tells P it is done. While a request still needs its remote KV, D's heartbeats keep P's lease alive; when
D gives up, it asks P to free the blocks at once rather than wait for the lease to run out. A read abandoned at
the load's deadline goes on moving bytes into D's blocks on the executor (nothing cancels a socket read or a
one-sided READ midway): the load fails only once that read ended, so its blocks are never recomputed in or
reused while it runs; the read's own deadline bounds the wait (`IN_FLIGHT_BOUND_S`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.ids import ReqId
from pdserve.kv_transfer.data_plane import DataPlaneError
from pdserve.kv_transfer.faults import InjectedFault
from pdserve.kv_transfer.integrity import invalid_blocks
from pdserve.kv_transfer.messages import Ack, Heartbeat, ReadDone, ReadGrant, ReadGrantReply
from pdserve.kv_transfer.peers import Address, Peer, Peers, TransferRefused
from pdserve.kv_transfer.runtime import AgentRuntime, LoadResult
from pdserve.kv_transfer.side_channel import SideChannelError

if TYPE_CHECKING:
    from pdserve.kv_transfer.vllm_nixl.consumer import VllmNixlConsumer

log = logging.getLogger(__name__)

# Failures a load expects (logged without a traceback); anything else is a bug.
_EXPECTED = (DataPlaneError, SideChannelError, OSError, TimeoutError, ConnectionError, InjectedFault)


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
    # Loads from vLLM: its blocks hold tokens [first_token, num_tokens) at its own block size.
    vllm: bool = False
    first_token: int = 0
    num_tokens: int = 0
    prompt_hash: str = ""  # the sequence this consumer expects the blocks to hold, for producers that bind them


class PullConsumer:
    """Owns loads and heartbeats. Thread-safe entry points for the engine thread; the work runs on the loop."""

    def __init__(self, rt: AgentRuntime, peers: Peers) -> None:
        self.rt = rt
        self.peers = peers
        self._lock = threading.Lock()
        self._completed: list[LoadResult] = []
        self._heartbeats: dict[Address, set[str]] = {}
        self._after: set[asyncio.Task] = set()  # read-done and releases that follow a fetch
        self.vllm: VllmNixlConsumer | None = None  # set when this instance loads KV from vLLM prefill instances

    # -- engine thread -------------------------------------------------------------------------------------
    def submit(self, job: LoadJob) -> None:
        if job.vllm and self.vllm is not None:
            self.rt.call(self.vllm.load(job, self._finish))
        else:
            self.rt.call(self._load(job))

    def take_completed(self) -> list[LoadResult]:
        with self._lock:
            out, self._completed = self._completed, []
        return out

    def watch(self, host: str, port: int, key: str) -> None:
        """Send heartbeats for this transfer until `unwatch`."""
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
        """Tell the producer to free a transfer's blocks now (fire and forget, with a deadline)."""
        self.rt.call(self.peers.release(host, port, key, token, reason))

    def send_vllm_release(self, host: str, port: int, engine_id: str, key: str) -> None:
        """Tell a vLLM producer to free a request's blocks now (its own notification; never a pdserve message)."""
        if self.vllm is not None:
            self.rt.call(self.vllm.release(host, port, engine_id, key))

    # -- the agent's loop ----------------------------------------------------------------------------------
    async def _load(self, job: LoadJob) -> None:
        self._finish(job, await self.fetch(job))

    async def fetch(self, job: LoadJob) -> LoadResult:
        """Read the granted blocks into ours; the bytes are in place (or the read surely over) when this returns,
        and P hears read-done, or a release after a failure, right after."""
        started = time.monotonic()
        moving: list[Future] = []
        try:
            nbytes, invalid, plane = await asyncio.wait_for(self._read(job, moving), job.deadline_s)
        except Exception as exc:  # noqa: BLE001 - any failure must fail this load, never strand the request
            await self._wait_out(job, moving)
            return self._failed(job, exc, started)
        seconds = time.monotonic() - started
        self.rt.stats.count_load(nbytes, seconds)
        self.rt.stats.blocks_invalid += len(invalid)
        if invalid:
            log.warning("KV load for %s: %d of %d blocks failed their checksum", job.request_id, len(invalid),
                        len(job.local_block_ids))
        # The bytes are in place: let the request run now, and tell P afterwards.
        self._later(self._read_done(job))
        return LoadResult(job.request_id, ok=True, nbytes=nbytes, seconds=seconds, invalid_blocks=invalid,
                          plane=plane, started_at=started)

    def _later(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._after.add(task)
        task.add_done_callback(self._after.discard)

    async def _read_done(self, job: LoadJob) -> None:
        try:
            done = await self.peers.request(job.host, job.port, ReadDone(key=job.key, token=job.token))
            if isinstance(done, Ack) and not done.ok:
                log.warning("producer did not accept read-done for %s: %s", job.key, done.error)
        except Exception as exc:  # noqa: BLE001 - the load is done; P's lease covers a lost read-done
            log.warning("read-done for %s not delivered (%s); P's lease will expire", job.key, exc)

    def _failed(self, job: LoadJob, exc: Exception, started: float) -> LoadResult:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        log.log(logging.WARNING if isinstance(exc, _EXPECTED) else logging.ERROR,
                "KV load for %s from %s:%d failed: %s", job.request_id, job.host, job.port, error,
                exc_info=not isinstance(exc, _EXPECTED))
        self.rt.stats.loads_failed += 1
        fatal = isinstance(exc, TransferRefused) and exc.refusal == "denied"
        if isinstance(exc, (SideChannelError, ConnectionError, OSError)):
            self.peers.drop((job.host, job.port))
        self._later(self.peers.release(job.host, job.port, job.key, job.token, "load failed"))
        return LoadResult(job.request_id, ok=False, error=error, fatal=fatal, started_at=started)

    def _finish(self, job: LoadJob, result: LoadResult) -> None:
        self.unwatch(job.host, job.port, job.key)
        with self._lock:
            self._completed.append(result)
        self.rt.on_event()

    async def _move(self, moving: list[Future], fn: Callable[..., Any], *args: Any) -> Any:
        """Run a read into our blocks on the executor, remembered in `moving` so a load that gives up on it can
        wait it out (cancelling the wait leaves the thread running)."""
        future = self.rt.executor.submit(fn, *args)
        moving.append(future)
        return await asyncio.wrap_future(future)

    async def _wait_out(self, job: LoadJob, moving: list[Future]) -> None:
        """Hold the load's blocks (quarantined) until a read still running into them ended."""
        running = [future for future in moving if not future.done()]
        if not running:
            return
        quarantined = len(job.local_block_ids)
        self.rt.stats.blocks_quarantined += quarantined
        try:
            await asyncio.wait([asyncio.wrap_future(future) for future in running])
        finally:
            self.rt.stats.blocks_quarantined -= quarantined

    async def _read(self, job: LoadJob, moving: list[Future]) -> tuple[int, list[int], str]:
        """Copy the granted blocks; returns (bytes, local blocks whose checksum did not match, data plane)."""
        peer = await self.peers.peer(job.host, job.port, job.engine_id)
        grant = await self.peers.request(job.host, job.port, ReadGrant(
            key=job.key, token=job.token, block_ids=list(job.remote_block_ids), prompt_hash=job.prompt_hash))
        if not isinstance(grant, ReadGrantReply):
            raise DataPlaneError(getattr(grant, "error", "") or "unexpected answer to a read grant")
        if not grant.ok:
            raise TransferRefused(grant.error or "the producer refused the read", grant.refusal or "denied")
        faults = self.rt.faults
        stall = faults.before_transfer("read")
        if stall:
            await asyncio.sleep(stall)
        local = list(job.local_block_ids)
        if peer.regrouper is not None:
            nbytes, invalid = await self._move(moving, self._read_regrouped, peer, job, local, grant.checksums)
            return nbytes, invalid, peer.plane
        nbytes = await self._move(moving, peer.channel.read_blocks, job.key, job.token, list(job.remote_block_ids),
                                  local)
        if faults.enabled:
            faults.damage(self.rt.regions, local, faults.lost_blocks(local))
        invalid = await self.rt.off_loop(invalid_blocks, self.rt.regions, local, grant.checksums)
        return nbytes, invalid, peer.plane

    def _read_regrouped(self, peer: Peer, job: LoadJob, local: list[int], checksums: list[int]
                        ) -> tuple[int, list[int]]:
        """A producer of another engine's layout: its blocks into a staging area, checked there (the checksums
        are of its bytes), then regrouped into our cache. Blocking (on the executor)."""
        assert peer.regrouper is not None
        staging, regions = peer.regrouper.staging(len(local))
        staged = list(range(len(local)))
        nbytes = peer.channel.read_into(job.key, job.token, list(job.remote_block_ids), staged, regions)
        faults = self.rt.faults
        if faults.enabled:
            faults.damage(regions, staged, faults.lost_blocks(staged))
        invalid = set(invalid_blocks(regions, staged, checksums))
        peer.regrouper.regroup(staging, self.rt.caches, local)
        return nbytes, [b for i, b in enumerate(local) if i in invalid]

    async def heartbeat(self) -> None:
        """Forever: renew the producers' leases on every transfer still watched."""
        interval = max(0.05, self.rt.config.lease_s / 6)
        while True:
            await asyncio.sleep(interval)
            with self._lock:
                targets = {address: sorted(keys) for address, keys in self._heartbeats.items() if keys}
            for (host, port), keys in targets.items():
                try:
                    await self.peers.request(host, port, Heartbeat(keys=keys))
                except Exception as exc:  # noqa: BLE001 - one peer's failure must not stop the others' heartbeats
                    log.warning("heartbeat to %s:%d failed: %s", host, port, exc)
