"""The store tier as a KV connector: a scheduler half that plans lookups, loads and writes, and a worker half that
runs them, joined only by `StoreMetadata` (as vLLM's store connectors are built).

Read path: when a request arrives its prompt's full blocks are looked up in the store (in the background). On
admission the scheduler has the longest run of blocks in its own prefix cache; the half answers how many blocks
right after that run the store has (`get_num_new_matched_tokens`, "ask again" while the lookup runs, at most
`lookup_timeout_s`), the request waits for their load like any remote KV, and only the rest is prefilled. The
worker checks each value whole (namespace, token ids, checksum, age) before it lands; blocks past the first bad
one are reported as load errors, so the scheduler computes them (whatever `kv_load_failure_policy` says: a store
miss is never the request's failure).

Write path: each step, the blocks that step fills completely (prompt or output) are planned as writes; after the
forward the worker copies them out of the cache (a memcpy) and the tier writes them on its own thread. A step never
waits for the store. The tier announces each block the store took (`KVStoreTier.on_stored`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.kv_cache_manager import block_extra_key
from pdserve.engine.outputs import KVConnectorOutput, SchedulerOutput, TransferRecord
from pdserve.engine.request import RequestStatus
from pdserve.ids import ReqId
from pdserve.kv_store.blocks import BlockIO, PoolBlocks, check_geometry
from pdserve.kv_store.codec import Expected
from pdserve.kv_store.keys import BlockChain
from pdserve.kv_store.tier import BlockRef, KVStoreTier, LoadResult, LoadTicket, StoredBlock
from pdserve.kv_transfer.base import KVConnectorMetadata, KVConnectorScheduler, KVConnectorWorker
from pdserve.kv_transfer.params import KVHandOff, RemotePrefill

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoreLoad:
    request_id: ReqId
    refs: tuple[BlockRef, ...]


@dataclass(frozen=True, slots=True)
class StoreWrite:
    block_id: int
    block: StoredBlock


@dataclass(slots=True)
class StoreMetadata(KVConnectorMetadata):
    loads: list[StoreLoad] = field(default_factory=list)
    writes: list[StoreWrite] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    request: Any  # pdserve's Request, or a view of vLLM's with the same fields
    chain: BlockChain
    lookup: Future | None = None
    lookup_first: int = 0  # the block the lookup starts at
    asked_at: float = 0.0
    load_first: int = 0  # the first block a planned load fills (the local hit's end)
    planned: bool = False  # allocated: from here on the request's KV is its own
    missing: int = 0  # blocks past the local hit the store lacks, counted once the request is admitted
    written: int = 0  # blocks [0, written) are written, loaded or left alone


class StoreConnectorScheduler(KVConnectorScheduler):
    def __init__(self, tier: KVStoreTier, block_size: int) -> None:
        self.tier = tier
        self.block_size = block_size
        self._tracked: dict[ReqId, _Tracked] = {}
        self._pending = StoreMetadata()
        self._loading: dict[ReqId, StoreLoad] = {}  # handed to the worker, not ended

    # -- admission --------------------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        if isinstance(request.kv_transfer_params, RemotePrefill):
            return  # its prompt's KV comes from a prefill instance
        chain = BlockChain(self.tier.namespace, getattr(request, "cache_salt", None) or "")
        tracked = self._tracked[request.request_id] = _Tracked(request, chain)
        self._ask(tracked, 0)  # early: the lookup runs while the request waits in the queue

    def _last_block(self, request: Any) -> int:
        """Blocks a hit may cover: whole blocks, leaving at least one token to compute (for the logits)."""
        return (request.num_tokens - 1) // self.block_size

    def _ask(self, tracked: _Tracked, first: int) -> None:
        last = self._last_block(tracked.request)
        if last <= first or not self.tier.available():
            tracked.lookup = None
            return
        self._extend(tracked, last)
        tracked.lookup = self.tier.lookup([tracked.chain.key(i) for i in range(first, last)])
        tracked.lookup_first, tracked.asked_at = first, time.monotonic()

    def _extend(self, tracked: _Tracked, num_full: int) -> None:
        request, bs = tracked.request, self.block_size
        tracked.chain.extend(num_full, request.token_ids_range, lambda i: block_extra_key(request, i, bs))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return 0, False
        if tracked.planned and request.status == RequestStatus.PREEMPTED:
            tracked.planned, tracked.lookup = False, None  # preempted: its blocks may come back from the store
        local, last = num_computed_tokens // self.block_size, self._last_block(request)
        if tracked.planned or local >= last:
            return 0, False
        if tracked.lookup is None or tracked.lookup_first > local:
            self._ask(tracked, local)
            if tracked.lookup is None:
                return 0, False
        if not tracked.lookup.done():
            if time.monotonic() - tracked.asked_at < self.tier.config.lookup_timeout_s:
                return None, False  # asked again at the next step; other requests run meanwhile
            self.tier.failed("a lookup ran past its deadline")
            tracked.lookup, tracked.missing = None, last - local
            return 0, False
        found = tracked.lookup.result()[local - tracked.lookup_first:last - tracked.lookup_first]
        run = next((i for i, present in enumerate(found) if not present), len(found))
        tracked.load_first, tracked.missing = local, (last - local) - run
        return (run * self.block_size, True) if run else (0, False)

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or tracked.planned:
            return
        tracked.planned = True
        self.tier.stats.miss_blocks += tracked.missing
        tracked.missing = 0
        if num_external_tokens == 0:
            return
        first, count = tracked.load_first, num_external_tokens // self.block_size
        chain, ns, bs = tracked.chain, self.tier.namespace, self.block_size
        refs = tuple(BlockRef(chain.key(i), Expected(ns.digest, chain.parent(i),
                                                     tuple(request.token_ids_range(i * bs, (i + 1) * bs)),
                                                     ns.block_bytes), block_ids[i])
                     for i in range(first, first + count))
        self._pending.loads.append(StoreLoad(request.request_id, refs))
        tracked.written = max(tracked.written, first + count)
        request.num_cached_tokens = (first + count) * bs  # corrected when fewer blocks turn out valid

    # -- the step ---------------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StoreMetadata:
        meta, self._pending = self._pending, StoreMetadata()
        self._loading.update((load.request_id, load) for load in meta.loads)
        for item in scheduler_output.scheduled:
            tracked = self._tracked.get(item.request_id)
            if tracked is not None:
                meta.writes.extend(self._filled(tracked, item.start_position, len(item.token_ids), item.block_ids))
        return meta

    def _filled(self, tracked: _Tracked, start: int, count: int, block_ids: list[int]) -> list[StoreWrite]:
        """The blocks this step fills completely, which it computes (a hit or a loaded block is not rewritten)."""
        full = (start + count) // self.block_size
        first = max(tracked.written, start // self.block_size)
        if full <= first:
            return []
        self._extend(tracked, full)
        chain, bs, request = tracked.chain, self.block_size, tracked.request
        tracked.written = full
        return [StoreWrite(block_ids[i], StoredBlock(chain.key(i), chain.hashes[i], chain.parent(i),
                                                     tuple(request.token_ids_range(i * bs, (i + 1) * bs))))
                for i in range(first, full)]

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving:
            load = self._loading.pop(rid, None)
            tracked = self._tracked.get(rid)
            if load is not None and tracked is not None:
                valid = next((i for i, ref in enumerate(load.refs) if ref.block_id in output.invalid_block_ids),
                             len(load.refs))
                tracked.request.num_cached_tokens = (tracked.load_first + valid) * self.block_size
                tracked.written = tracked.load_first + valid  # the blocks computed instead are written

    def has_pending_work(self) -> bool:
        return bool(self._loading or self._pending.loads)

    # -- endings ----------------------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, KVHandOff | None]:
        rid = request.request_id
        self._tracked.pop(rid, None)
        if rid in self._loading:
            return True, None  # the load may still be copying into its blocks: freed once it ended
        self._pending.loads = [load for load in self._pending.loads if load.request_id != rid]
        return False, None


class StoreConnectorWorker(KVConnectorWorker):
    def __init__(self, tier: KVStoreTier) -> None:
        self.tier = tier
        self.blocks: BlockIO | None = None
        self._meta: StoreMetadata | None = None
        self._tickets: dict[ReqId, LoadTicket] = {}
        self._invalid: set[int] = set()
        self._records: dict[ReqId, TransferRecord] = {}

    def register_kv_caches(self, kv_cache: Any) -> None:
        check_geometry(self.tier.namespace, kv_cache[0].numel() * kv_cache.element_size(), kv_cache.shape[1])
        self.attach(PoolBlocks(kv_cache))

    def attach(self, blocks: BlockIO) -> None:
        self.blocks = blocks

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, StoreMetadata)
        self._meta = metadata

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        if self._meta is None or self.blocks is None:
            return
        for load in self._meta.loads:
            self._tickets[load.request_id] = self.tier.load(load.request_id, list(load.refs), self.blocks)

    def wait_for_save(self) -> None:
        """The step's forward is over: copy out the blocks it filled and hand them to the writer."""
        if self._meta is None or self.blocks is None or not self._meta.writes:
            return
        writes = self._meta.writes
        self.tier.write([w.block for w in writes], self.blocks.read([w.block_id for w in writes]))

    def get_finished(self, finished_req_ids: set[ReqId]) -> tuple[set[ReqId], set[ReqId]]:
        recving: set[ReqId] = set()
        now = time.monotonic()
        for rid, ticket in list(self._tickets.items()):
            if ticket.future.done():
                result = ticket.future.result()
            elif now > ticket.deadline and ticket.abandon():
                self.tier.failed("a load ran past its deadline")
                result = LoadResult(rid, len(ticket.refs), why="the load ran past its deadline")
            else:
                continue
            del self._tickets[rid]
            recving.add(rid)
            self._settle(ticket, result)
        return set(), recving

    def _settle(self, ticket: LoadTicket, result: LoadResult) -> None:
        bad = [ref.block_id for ref in ticket.refs[result.num_valid:]]
        stats = self.tier.stats
        stats.hit_blocks += result.num_valid
        stats.miss_blocks += len(bad)
        stats.bytes_read += result.nbytes
        self._invalid.update(bad)
        self._records[ticket.request_id] = TransferRecord(result.started_at or time.monotonic(), result.seconds,
                                                          result.nbytes, f"store:{self.tier.backend.name}", not bad)
        if bad:
            log.info("request %s: %d of %d blocks from the KV store used, the rest computed (%s)", ticket.request_id,
                     result.num_valid, len(ticket.refs), result.why)

    def has_pending_work(self) -> bool:
        return bool(self._tickets)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def get_transfer_records(self) -> dict[ReqId, TransferRecord]:
        records, self._records = self._records, {}
        return records

    def shutdown(self) -> None:
        self.tier.close()
