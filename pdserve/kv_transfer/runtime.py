"""What the transfer agent's owners share: its config, counters, fault injector, executor and event loop.

Each owner (pull producer, pull consumer, push producer and consumer, peers) keeps its own state under its own
lock; this is only the plumbing they all need, so none of them has to reach into the agent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.ids import ReqId
from pdserve.kv_transfer.data_plane import DataPlane
from pdserve.kv_transfer.data_plane.regions import BlockRegions
from pdserve.kv_transfer.faults import FaultConfig, FaultInjector
from pdserve.kv_transfer.messages import KVLayout
from pdserve.kv_transfer.peer_policy import PeerPolicy

log = logging.getLogger(__name__)


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
    # Keep the blocks of a push D gave up on out of use until no write of P's can still land in them (P's word,
    # P's process gone, or the in-flight bound). Off: they are recomputed in at once, the old trade-off.
    push_quarantine: bool = False
    migration_bytes_per_s: float = 0.0  # a live migration's bulk copy pace from this instance (0: unpaced)
    capture_path: str | None = None  # append every side-channel message here (drills, tests)
    preferred_plane: str = "auto"  # "auto": the first common plane that connects (peers.AUTO_ORDER)
    planes: dict[str, DataPlane] = field(default_factory=dict)
    faults: FaultConfig = field(default_factory=FaultConfig)
    peers: PeerPolicy = field(default_factory=lambda: PeerPolicy.from_config(None))  # whom we may dial
    layout: KVLayout | None = None  # what our blocks are, for peers of another engine (None: opaque copies only)
    layer_caches: tuple[torch.Tensor, ...] = ()  # another engine's cache, a tensor per layer (empty: pdserve's pool)


@dataclass(slots=True)
class AgentStats:
    """Counters behind ``/metrics``; each owner bumps its own fields."""

    bytes_received: int = 0
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
    # A gauge: blocks of transfers D gave up on that a peer may still be moving bytes into, held until it says
    # it stopped (or its transfer has surely ended); in use, but not leaked.
    blocks_quarantined: int = 0

    def count_load(self, nbytes: int, seconds: float) -> None:
        self.loads_ok += 1
        self.bytes_received += nbytes
        self.load_seconds_total += seconds


@dataclass(slots=True)
class LoadResult:
    """How a consumer's transfer ended (a pull load or a push), for the worker half to report."""

    request_id: ReqId
    ok: bool
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    invalid_blocks: list[int] = field(default_factory=list)  # local blocks that arrived damaged
    fatal: bool = False  # refused as never granted: the request must fail whatever the policy
    mismatch: bool = False  # refused because the producer's KV belongs to another prompt
    plane: str = ""  # the data plane the bytes came over ("" if none was reached)
    started_at: float = 0.0  # time.monotonic() when the transfer began (load submitted, push registered)


def _log_failure(future: Any) -> None:
    """Background coroutines handle their own errors; one that escapes is a bug worth a traceback."""
    if not future.cancelled() and future.exception() is not None:
        log.error("KV agent task failed", exc_info=future.exception())


def _nothing() -> None:
    pass


@dataclass(slots=True)
class AgentRuntime:
    config: AgentConfig
    stats: AgentStats = field(default_factory=AgentStats)
    faults: FaultInjector = field(default_factory=lambda: FaultInjector(FaultConfig()))
    # Checksums, data-plane connects and reads run here, off the agent's event loop.
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdserve-transfer"))
    loop: asyncio.AbstractEventLoop | None = None
    port: int = 0  # the side channel's, once bound
    on_event: Callable[[], None] = _nothing  # wakes the engine loop when a transfer event lands

    @property
    def pool(self) -> torch.Tensor:
        """The local KV pool (every data plane serves the same one)."""
        return next(iter(self.config.planes.values())).kv

    @property
    def regions(self) -> BlockRegions:
        """Where each local block's bytes are (pdserve's pool or another engine's per-layer cache)."""
        regions = next(iter(self.config.planes.values())).regions
        assert regions is not None, "the KV cache is not registered yet"
        return regions

    @property
    def caches(self) -> tuple[torch.Tensor, ...]:
        """The local cache as tensors, for regrouping another layout's blocks into it."""
        return self.config.layer_caches or (self.pool,)

    def call(self, coro: Coroutine[Any, Any, Any]) -> None:
        """From any thread: run a coroutine on the agent's loop, fire and forget (failures are logged)."""
        assert self.loop is not None
        asyncio.run_coroutine_threadsafe(coro, self.loop).add_done_callback(_log_failure)

    def call_and_wait(self, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        """From a thread other than the agent's: run a coroutine on its loop and wait for the result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def off_loop(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """On the agent's loop: run blocking work on the executor."""
        return asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
