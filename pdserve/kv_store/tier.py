"""The store tier's client, one per instance: lookups, loads and writes, each on a thread of the tier's own.

The engine thread only submits work and collects futures; nothing it calls waits on the network. Reads (lookups,
loads) and writes run on separate threads, so a slow write never holds up a request's lookup. A failed or
overdue call opens a circuit breaker: for `retry_after_s` the store is not called at all (lookups answer "no
blocks" at once, writes are dropped), then one call tries again. A store that is down costs a request nothing
but its prefill.

A load checks every value whole before any byte lands in the cache (`codec.decode`), stops at the first block
that fails, and uses the valid blocks before it: a hit is never used unless its token ids are the prompt's. A
refused value is removed from the store, so the block's recompute can be written in its place (Mooncake keeps
the first value written under a key).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import urlsplit

import torch

from pdserve.ids import ReqId
from pdserve.kv_store.backends import StoreBackend, StoreUnavailable, make_backend
from pdserve.kv_store.blocks import BlockIO
from pdserve.kv_store.codec import Expected, Refused, decode, encode
from pdserve.kv_store.config import StoreConfig
from pdserve.kv_store.keys import Namespace
from pdserve.kv_store.metrics import StoreStats

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A full block as written to the store; announced to `on_stored` listeners once the store took it."""

    key: str
    block_hash: bytes
    parent: bytes
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockRef:
    """A block to load: its key, what it must hold, and the cache block it goes into."""

    key: str
    expected: Expected
    block_id: int


@dataclass(slots=True)
class LoadResult:
    request_id: ReqId
    num_blocks: int
    num_valid: int = 0  # leading blocks loaded and verified (the rest are computed)
    nbytes: int = 0
    started_at: float = 0.0
    seconds: float = 0.0
    why: str = ""  # why the blocks past the valid ones were not used


@dataclass(slots=True)
class LoadTicket:
    """A load in flight. At its deadline the worker abandons it, unless its bytes are already being copied into
    the cache (a local copy, soon over): then it waits that out, so no late copy lands in reused blocks."""

    request_id: ReqId
    refs: list[BlockRef]
    deadline: float
    future: Future = field(default_factory=Future)
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False
    copying: bool = False

    def abandon(self) -> bool:
        with self.lock:
            if not self.copying:
                self.abandoned = True
            return self.abandoned


class KVStoreTier:
    def __init__(self, config: StoreConfig, namespace: Namespace, backend: StoreBackend | None = None) -> None:
        self.config = config
        self.namespace = namespace
        self.backend = backend or make_backend(config)
        self.stats = StoreStats()
        self.on_event: Callable[[], None] = lambda: None  # wakes the engine when a lookup or load ends
        self.on_stored: list[Callable[[list[StoredBlock]], None]] = []
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="pdserve-kv-store-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pdserve-kv-store-write")
        self._lock = threading.Lock()  # counters and the breaker: the engine thread takes it, so never held long
        # Connecting can wait on the network up to the client's own timeouts; it has a lock of its own, so the
        # engine's `write` never waits behind a store that does not answer.
        self._connect_lock = threading.Lock()
        self._connected = False
        self._down_until = 0.0

    @property
    def identity(self) -> str:
        """The store and the key namespace, as KV events name them: instances that say the same read each other's
        blocks. The URL keeps only scheme, host, port and path (it is published: no credentials)."""
        parts = urlsplit(self.config.url)
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{parts.hostname}{port}{parts.path}#{self.namespace.tag}"

    # -- availability -----------------------------------------------------------------------------------
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, fn: Callable[[StoreBackend], T]) -> T:
        """One backend call on a tier thread; a failure opens the breaker and is raised."""
        try:
            with self._connect_lock:
                if not self._connected:
                    self.backend.connect()
                    self._connected = True
            result = fn(self.backend)
        except Exception as exc:  # noqa: BLE001 - whatever the store or its client raised, the store failed
            self.failed(f"{type(exc).__name__}: {exc}", reconnect=not isinstance(exc, StoreUnavailable))
            raise StoreUnavailable(str(exc)) from exc
        if not self.stats.up:
            log.info("KV store %s answers again", self.config.url)
            self.stats.up = 1
        return result

    def connect_soon(self) -> None:
        """Connect on the reader thread now rather than at the first lookup: a new instance's first requests would
        otherwise wait for the store client's import and setup (Mooncake's: tens of ms on a quiet box, hundreds on a
        busy one). A store that is down now is treated as at any call: left alone for `retry_after_s`."""
        def run() -> None:
            try:
                self._call(lambda _: None)
            except StoreUnavailable:
                pass
        self._reader.submit(run)

    def failed(self, why: str, reconnect: bool = False) -> None:
        """A call failed or ran past its deadline: leave the store alone for a while."""
        self.stats.errors += 1
        with self._lock:
            self._down_until = time.monotonic() + self.config.retry_after_s
            if reconnect:
                self._connected = False
        if self.stats.up:
            log.warning("KV store %s failed (%s): prefilling without it for %.0f s, then trying again",
                        self.config.url, why, self.config.retry_after_s)
            self.stats.up = 0

    # -- lookups ----------------------------------------------------------------------------------------
    def lookup(self, keys: list[str]) -> Future:
        """Which of `keys` the store has (a list of bools, all False when it cannot say)."""
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(keys)
        if not self.available():
            future: Future = Future()
            future.set_result([False] * len(keys))
            return future
        future = self._reader.submit(self._exists, keys)
        future.add_done_callback(lambda _: self.on_event())
        return future

    def _exists(self, keys: list[str]) -> list[bool]:
        try:
            return self._call(lambda b: b.exists(keys))
        except StoreUnavailable:
            return [False] * len(keys)

    # -- loads ------------------------------------------------------------------------------------------
    def load(self, request_id: ReqId, refs: list[BlockRef], blocks: BlockIO) -> LoadTicket:
        ticket = LoadTicket(request_id, refs, time.monotonic() + self.config.load_timeout_s)
        if not self.available():
            ticket.future.set_result(LoadResult(request_id, len(refs), why="the store is unavailable"))
            return ticket
        future = self._reader.submit(self._load, ticket, blocks)
        future.add_done_callback(lambda f: self._settle(ticket, f))
        return ticket

    def _settle(self, ticket: LoadTicket, future: Future) -> None:
        exc = future.exception()
        result = LoadResult(ticket.request_id, len(ticket.refs), why=f"load failed: {exc}") if exc else future.result()
        ticket.future.set_result(result)
        self.on_event()

    def _load(self, ticket: LoadTicket, blocks: BlockIO) -> LoadResult:
        started = time.monotonic()
        result = LoadResult(ticket.request_id, len(ticket.refs), started_at=started)
        try:
            values = self._call(lambda b: b.get([ref.key for ref in ticket.refs]))
        except StoreUnavailable as exc:
            result.why = str(exc)
            return result
        valid, result.why = self._verify(ticket.refs, values)
        with ticket.lock:
            if ticket.abandoned:
                return result
            ticket.copying = True
        blocks.write([ref.block_id for ref in ticket.refs[:len(valid)]], valid)
        result.num_valid = len(valid)
        result.nbytes = sum(v.nbytes for v in valid)
        result.seconds = time.monotonic() - started
        return result

    def _verify(self, refs: list[BlockRef], values: list[bytes | None]) -> tuple[list[memoryview], str]:
        """The leading values that hold what the prompt needs, and why the next one does not (or "")."""
        valid: list[memoryview] = []
        now = time.time()
        for ref, value in zip(refs, values, strict=True):
            try:
                valid.append(decode(value, ref.expected, now, self.config.ttl_s))
            except Refused as refused:
                self.stats.refused[refused.reason] += 1
                if refused.reason != "missing":
                    self.remove([ref.key])
                return valid, f"block {ref.key} refused: {refused}"
        return valid, ""

    # -- writes -----------------------------------------------------------------------------------------
    def write(self, blocks: list[StoredBlock], staged: torch.Tensor) -> None:
        """Write staged blocks (`[n, block_bytes]`, a copy the caller no longer touches) in the background, or
        drop them when the queue is full or the store down: a write is never waited for."""
        nbytes = staged.numel()
        with self._lock:
            room = self.stats.queued_bytes + nbytes <= self.config.write_queue_bytes
            if room and self.available():
                self.stats.queued_bytes += nbytes
            else:
                self.stats.writes_dropped += len(blocks)
                return
        self._writer.submit(self._write, blocks, staged)

    def _write(self, blocks: list[StoredBlock], staged: torch.Tensor) -> None:
        try:
            now = time.time()
            rows = staged.numpy()
            items = [(b.key, encode(self.namespace.digest, b.parent, list(b.token_ids), memoryview(rows[i]), now))
                     for i, b in enumerate(blocks)]
            taken = self._call(lambda backend: backend.put(items, self.config.ttl_s))
        except StoreUnavailable:
            self.stats.writes_dropped += len(blocks)
            return
        finally:
            with self._lock:
                self.stats.queued_bytes -= staged.numel()
        stored = [b for b, ok in zip(blocks, taken, strict=True) if ok]
        self.stats.blocks_written += len(stored)
        self.stats.bytes_written += len(stored) * self.namespace.block_bytes
        self.stats.write_refused += len(blocks) - len(stored)
        for listener in self.on_stored:
            if stored:
                listener(stored)

    def remove(self, keys: list[str]) -> None:
        def run() -> None:
            try:
                self._call(lambda b: b.remove(keys))
            except StoreUnavailable:
                pass
        self._writer.submit(run)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every write submitted so far has ended (tests, benchmarks, shutdown)."""
        try:
            self._writer.submit(lambda: None).result(timeout_s)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        for pool in (self._reader, self._writer):
            pool.shutdown(wait=True, cancel_futures=True)
        self.backend.close()
