"""The target side of a migration: blocks reserved and read stage by stage, then the request taken over.

Each stage is read from the source's blocks through the transfer agent, as a pull reads a prefill instance's:
a grant under the source's lease (its capability token, and the token ids the blocks must hold), the copy over
the data plane both offer, checksums, read-done. A stage that fails frees what the migration holds here (after
any read into it surely ended); so does a migration whose next stage does not come in time, or whose request,
taken over, no gateway attaches to. The gateway's attach to a migration that never completed ends it too.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.block_pool import KVBlock
from pdserve.ids import ReqId, make_internal_request_id
from pdserve.kv_transfer.agent import TransferAgent
from pdserve.kv_transfer.params import prompt_hash
from pdserve.kv_transfer.pull_consumer import LoadJob
from pdserve.migration import engine_ops
from pdserve.migration.settings import MigrationSettings
from pdserve.migration.wire import Abandon, CopyStage, MigrationError, RequestState, Source
from pdserve.telemetry.timeline import TimelineStore
from pdserve.utils import cdiv

log = logging.getLogger(__name__)
_REAP_INTERVAL_S = 0.5
SPARE_BLOCKS = 2  # reserved ahead of the last stage (at most FINAL_BLOCKS + the partly filled one)


@dataclass(eq=False)
class Incoming:
    id: str
    token: str
    source: Source
    blocks: list[KVBlock] = field(default_factory=list)  # reserved here, the KV read so far
    spare: list[KVBlock] = field(default_factory=list)  # reserved here for the stages to come
    token_ids: list[int] = field(default_factory=list)  # whose KV the blocks hold
    busy: asyncio.Task | None = None  # a stage being read (or the request being taken over)
    touched: float = field(default_factory=time.monotonic)
    rid: ReqId | None = None  # once taken over
    state: RequestState | None = None  # as it was taken over (the attach catches its client up from it)


class MigrationTarget:
    def __init__(self, engine: AsyncEngine, agent: TransferAgent, settings: MigrationSettings, block_size: int,
                 timelines: TimelineStore) -> None:
        self.engine = engine
        self.agent = agent
        self.settings = settings
        self.block_size = block_size
        self.timelines = timelines
        self.incoming: dict[str, Incoming] = {}
        self.taken_over = 0  # requests that moved here with their KV
        self.resumed = 0  # requests that moved here by their tokens alone (recomputed)
        self.refusal: Callable[[], str] = lambda: ""  # why no migration is taken now ("" : they are)

    # -- a stage -------------------------------------------------------------------------------------------
    async def stage(self, message: CopyStage) -> None:
        """Read one stage's blocks (and, on the last, take the request over); MigrationError says why not."""
        record = self._record_for(message)
        if record.busy is not None or record.rid is not None:
            raise MigrationError(409, f"migration {message.migration_id} is busy or complete here")
        if message.first_block != len(record.blocks) or message.token_ids[:len(record.token_ids)] != record.token_ids \
                or cdiv(len(message.token_ids), self.block_size) != message.first_block + len(message.block_ids):
            await self.drop(record, "a stage out of order")
            raise MigrationError(400, "the stage does not follow the blocks and tokens of the previous one")
        record.busy = asyncio.get_running_loop().create_task(self._stage(record, message))
        await asyncio.shield(record.busy)  # a source that hangs up does not stop a read midway

    async def _stage(self, record: Incoming, message: CopyStage) -> None:
        try:
            await self._take(record, message)
        except BaseException:
            await self.drop(record, "its stage failed")
            raise
        finally:
            record.busy = None
            record.touched = time.monotonic()

    def _record_for(self, message: CopyStage) -> Incoming:
        record = self.incoming.get(message.migration_id)
        if record is not None:
            if not secrets.compare_digest(record.token, message.token) or record.source != message.source:
                raise MigrationError(403, "wrong token or source for this migration")
            return record
        refusal = self.refusal()
        if refusal:
            raise MigrationError(409, f"this instance takes no migrations now: {refusal}")
        if message.first_block != 0 or len(message.token) < 16 or len(message.read_token) < 16:
            raise MigrationError(404, f"no migration {message.migration_id} here, and this is not its first stage")
        record = self.incoming[message.migration_id] = Incoming(message.migration_id, message.token, message.source)
        return record

    async def _take(self, record: Incoming, message: CopyStage) -> None:
        needed = len(message.block_ids)
        if needed > len(record.spare):
            # A few more than asked: the last stage (a block or two) then reads into blocks already here, without
            # waiting for a step to end while the request is stopped.
            more = needed - len(record.spare) + (0 if message.final is not None else SPARE_BLOCKS)
            record.spare += await self.engine.call(lambda e: engine_ops.reserve(e, more))
        blocks, record.spare = record.spare[:needed], record.spare[needed:]
        record.blocks += blocks
        if blocks:
            await self._read(record, message, [b.block_id for b in blocks])
        record.token_ids = list(message.token_ids)
        if message.final is not None:
            await self._adopt(record, message.final)

    async def _read(self, record: Incoming, message: CopyStage, local: list[int]) -> None:
        source = message.source
        job = LoadJob(request_id=ReqId(f"migration:{record.id}"), host=source.host, port=source.port,
                      engine_id=source.engine_id, key=message.key, token=message.read_token,
                      remote_block_ids=tuple(message.block_ids), local_block_ids=tuple(local),
                      deadline_s=self.settings.stage_timeout_s, prompt_hash=prompt_hash(message.token_ids))
        try:
            await self.agent.config.peers.check(source.host)
        except ValueError as exc:
            raise MigrationError(400, f"source: {exc}") from exc
        result = await on_loop(self.agent.rt.loop, self.agent.pull_consumer.fetch(job))
        if not result.ok:
            raise MigrationError(502, f"reading the source's blocks failed: {result.error}")
        if result.invalid_blocks:
            raise MigrationError(502, f"{len(result.invalid_blocks)} blocks arrived damaged (checksums)")

    async def _adopt(self, record: Incoming, state: RequestState) -> None:
        rid = make_internal_request_id(state.external_id)
        timeline = self.timelines.start(state.request_id, "decode", internal_request_id=rid)
        blocks, computed = record.blocks, len(record.token_ids)
        self.engine.open_stream(rid)
        try:
            await self.engine.call(lambda e: engine_ops.adopt(e, rid, state, blocks, computed, timeline))
        except BaseException:
            self.engine.close_stream(rid)
            raise
        record.blocks = []  # the request's now
        record.rid, record.state = rid, state
        self.taken_over += 1
        await self._release(record.spare)
        record.spare = []

    async def resume(self, state: RequestState) -> ReqId:
        """A request handed over by its tokens alone (its source died, or was told to): it recomputes them here."""
        rid = make_internal_request_id(state.external_id)
        timeline = self.timelines.start(state.request_id, "decode", internal_request_id=rid)
        self.engine.open_stream(rid)
        try:
            await self.engine.call(lambda e: engine_ops.adopt(e, rid, state, [], 0, timeline))
        except BaseException:
            self.engine.close_stream(rid)
            raise
        self.resumed += 1
        return rid

    # -- the gateway's attach, and endings -----------------------------------------------------------------
    async def attach(self, migration_id: str, token: str) -> tuple[ReqId, RequestState]:
        """The request a completed migration took over, and its outputs then; a migration that did not complete
        is ended (the gateway gave up on it) and answers 404."""
        record = self.incoming.get(migration_id)
        if record is None or not secrets.compare_digest(record.token, token):
            raise MigrationError(404, "no such migration here (unknown id or wrong token)")
        if record.busy is not None:
            await asyncio.wait({record.busy})
        if record.rid is None:
            await self.drop(record, "the gateway went on without it")
            raise MigrationError(404, f"migration {migration_id} did not complete here")
        del self.incoming[migration_id]
        return record.rid, record.state

    async def abandon(self, message: Abandon) -> bool:
        record = self.incoming.get(message.migration_id)
        if record is None or not secrets.compare_digest(record.token, message.token):
            return False
        if record.busy is not None:
            await asyncio.wait({record.busy})
        await self.drop(record, message.reason or "the source abandoned it")
        return True

    async def drop(self, record: Incoming, reason: str) -> None:
        """Free what the migration holds here: reserved blocks (no read into them is running: stages wait theirs
        out), or the request it took over and nobody attached to."""
        if self.incoming.get(record.id) is record:
            del self.incoming[record.id]
        log.info("migration %s dropped here: %s", record.id, reason)
        blocks, record.blocks, record.spare = record.blocks + record.spare, [], []
        await self._release(blocks)
        if record.rid is not None:
            self.engine.abort(record.rid)
            self.engine.close_stream(record.rid)

    async def _release(self, blocks: list[KVBlock]) -> None:
        if blocks:
            await asyncio.shield(self.engine.call(lambda e: engine_ops.release(e, blocks)))

    async def reap(self) -> None:
        """Forever: end migrations whose source went quiet, and requests taken over that nobody attached to."""
        while True:
            await asyncio.sleep(_REAP_INTERVAL_S)
            now = time.monotonic()
            for record in list(self.incoming.values()):
                limit = self.settings.unattached_timeout_s if record.rid is not None else self.settings.idle_timeout_s
                if record.busy is None and now - record.touched > limit:
                    await self.drop(record, f"nothing came for {limit:g} s")

    def num_held(self) -> int:
        return sum(len(record.blocks) + len(record.spare) for record in self.incoming.values())


async def on_loop(loop: asyncio.AbstractEventLoop | None, work: Coroutine[Any, Any, Any]) -> Any:
    """Run `work` on another thread's event loop (the transfer agent's) and wait for it here. Not cancelled with
    the caller: a read it started must end before its blocks are used again."""
    assert loop is not None
    return await asyncio.shield(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, loop)))
