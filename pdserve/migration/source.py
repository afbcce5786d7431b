"""The source side of a migration: which running requests may move, and moving one.

A request may move when it came through a gateway that splices streams (its leg carried SPLICE_HEADER), samples
one sequence and has no images. Moving it (Llumnix's multi-stage copy): its stream ends with a `Handoff`, the
gateway comes back for the rest of it (the window leg, which names each token it carries), and meanwhile the
target reads the blocks the request filled so far, stage after stage, while it keeps decoding here. Once a stage
finds at most FINAL_BLOCKS new blocks, the request stops after its step, the target reads the rest and takes it
over, and the window leg ends with `HandedOver`. Anything that fails before that lets the request run on here;
every block pinned for a reader and every lease is given back whatever happens.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.request import RequestStatus
from pdserve.ids import ReqId
from pdserve.kv_transfer.agent import TransferAgent
from pdserve.kv_transfer.params import prompt_hash
from pdserve.migration import engine_ops
from pdserve.migration.client import TargetClient, base_url
from pdserve.migration.engine_ops import Pinned
from pdserve.migration.settings import MigrationSettings
from pdserve.migration.wire import (CopyStage, HandedOver, Handoff, MigrateRequest, MigrateResult, MigrationError,
                                    RequestState, Source)
from pdserve.utils import pace_bytes_per_s

log = logging.getLogger(__name__)

FINAL_BLOCKS = 1  # a stage that found at most this many newly filled blocks is the last one before the stop
MAX_STAGES = 8  # stages that did not converge (a paced copy's full stages count only once past the first bulk)
PACED_STAGE_S = 0.1  # a paced copy moves about this long's allowance per stage: a decode step's worth or two


@dataclass(eq=False)
class Tracked:
    """A request this instance serves that may move: its client-visible id, its engine id, its current leg."""

    request_id: str
    rid: ReqId
    stream: bool
    tagged: bool = False  # its leg is a window leg: every output names its token ids for the gateway
    migration: Migration | None = None


@dataclass(eq=False)
class Migration:
    id: str
    token: str  # the capability the gateway and the target both hold
    read_token: str  # the leases' (the target's alone)
    tracked: Tracked
    to: str | None
    mode: str
    rate_bytes_per_s: float
    window: asyncio.Future = field(repr=False)  # the window leg's `to`, once the gateway came back
    done: asyncio.Future = field(repr=False)  # the MigrateResult
    task: asyncio.Task | None = field(default=None, repr=False)
    # What the first leg sent (its outputs and their logprobs): the window leg goes on from there.
    prefix: tuple[list[int], list[Any]] = ((), ())
    handed_over: HandedOver | None = None


@dataclass(slots=True)
class Pace:
    """A live move's bulk copy at `rate` bytes per second (0: unpaced): stages of a bounded size, and a wait after
    each until the bytes sent so far are due."""

    rate: float
    block_bytes: int
    clock: Callable[[], float] = time.monotonic
    started: float = -1.0
    sent: int = 0

    def __post_init__(self) -> None:
        self.started = self.clock()

    def stage_blocks(self) -> int:
        """How many blocks the next stage may copy (0: all that are filled)."""
        return max(1, int(self.rate * PACED_STAGE_S) // self.block_bytes) if self.rate else 0

    def wait_after(self, blocks: int) -> float:
        """Count a stage's blocks as sent; seconds until everything sent so far is due at the rate (0: now)."""
        self.sent += blocks * self.block_bytes
        return max(0.0, self.started + self.sent / self.rate - self.clock()) if self.rate else 0.0

    async def after(self, blocks: int) -> None:
        wait = self.wait_after(blocks)
        if wait:
            await asyncio.sleep(wait)


class SourceGone(Exception):
    """The request ended (finished, aborted) while it was being moved."""


class MigrationSource:
    def __init__(self, engine: AsyncEngine, agent: TransferAgent, identity: Source, targets: TargetClient,
                 settings: MigrationSettings) -> None:
        self.engine = engine
        self.agent = agent
        self.identity = identity
        self.targets = targets
        self.settings = settings
        self.tracked: dict[str, Tracked] = {}
        self.migrations: dict[str, Migration] = {}
        self.outcomes: dict[str, int] = {}  # moves started here, by how they ended
        self._later: set[asyncio.Task] = set()

    # -- which requests may move -------------------------------------------------------------------------
    def register(self, tracked: Tracked) -> None:
        self.tracked[tracked.request_id] = tracked

    def leg_ended(self, tracked: Tracked, moved: bool) -> None:
        """A leg of the request ended: with a marker (`moved`), or otherwise (finished, failed, client gone)."""
        migration = tracked.migration
        if moved and migration is not None and migration.handed_over is None:
            return  # the Handoff: the window leg comes next
        if self.tracked.get(tracked.request_id) is tracked:
            del self.tracked[tracked.request_id]
        if migration is None:
            return
        self.migrations.pop(migration.id, None)
        if migration.task is not None and not migration.task.done():
            migration.task.cancel()  # the client left (or the request ended here): nothing to move any more
        elif migration.handed_over is not None and not moved:  # it left between the handover and the marker
            handed = migration.handed_over
            task = asyncio.get_running_loop().create_task(self.targets.abandon(handed.to, handed.migration_id,
                                                                               handed.token, "the client left"))
            self._later.add(task)
            task.add_done_callback(self._later.discard)

    # -- starting ------------------------------------------------------------------------------------------
    async def migrate(self, ask: MigrateRequest) -> list[MigrateResult]:
        """`POST /v1/migrate`: move the named request, or `count` of them, and report how each went."""
        if ask.mode not in ("live", "stop-copy", "recompute"):
            raise MigrationError(400, f"mode must be live, stop-copy or recompute, got {ask.mode!r}")
        try:
            rate = (self.settings.rate_bytes_per_s if ask.max_mib_per_s is None
                    else pace_bytes_per_s(ask.max_mib_per_s, "max_mib_per_s"))
        except ValueError as exc:
            raise MigrationError(400, str(exc)) from exc
        if ask.to is not None:
            await self.check_target(ask.to)
        chosen = [self._named(ask.request_id)] if ask.request_id is not None else await self._pick(ask.count,
                                                                                                    ask.max_share)
        started = [self._start(tracked, ask.to, ask.mode, rate) for tracked in chosen]
        return list(await asyncio.gather(*(m.done for m in started)))

    def _named(self, request_id: str) -> Tracked:
        tracked = self.tracked.get(request_id)
        if tracked is None:
            raise MigrationError(404, f"no request {request_id!r} that can move is running here (unknown, "
                                      "finished, sampling n > 1, with images, or not sent by a splicing gateway)")
        if tracked.migration is not None:
            raise MigrationError(409, f"request {request_id!r} is being moved already")
        return tracked

    async def _pick(self, count: int, max_share: float) -> list[Tracked]:
        """The `count` movable requests holding the most KV (moving them frees the most), each at most
        `max_share` of the cache."""
        free = [t for t in self.tracked.values() if t.migration is None]
        rids = [t.rid for t in free]
        shares = await self.engine.call(lambda e: {r: len(e.kv.block_ids(r)) / e.kv.num_blocks for r in rids
                                                   if r in e.scheduler.requests})
        free = [t for t in free if shares.get(t.rid, 2.0) <= max_share]
        return sorted(free, key=lambda t: shares[t.rid], reverse=True)[:max(count, 0)]

    async def check_target(self, url: str) -> str:
        """The target may take this instance's requests: a decode instance accepting them, with the same model,
        dtype and KV layout (its compatibility hash); MigrationError with a 4xx saying why not."""
        url, host, _ = base_url(url)
        await self._allowed(host)
        status = await self.targets.status(url)
        if status.role != "decode":
            raise MigrationError(400, f"{url} is not a decode instance (its role is {status.role})")
        if status.engine_id == self.identity.engine_id:
            raise MigrationError(400, f"{url} is this instance, where the request runs already")
        if not status.accepting:
            raise MigrationError(409, f"{url} takes no migrations now: {status.reason}")
        if status.compat_hash != self.agent.config.compat_hash:
            raise MigrationError(409, f"{url} runs another model or KV layout ({status.layout}); its KV cannot "
                                      "continue this instance's requests")
        return url

    async def _allowed(self, host: str) -> None:
        try:
            await self.agent.config.peers.check(host)
        except ValueError as exc:
            raise MigrationError(400, f"'to': {exc}") from exc

    def _start(self, tracked: Tracked, to: str | None, mode: str, rate_bytes_per_s: float) -> Migration:
        loop = asyncio.get_running_loop()
        migration = Migration(f"mig-{uuid.uuid4().hex}", secrets.token_hex(16), secrets.token_hex(16), tracked,
                              to, mode, rate_bytes_per_s, loop.create_future(), loop.create_future())
        tracked.migration = migration
        self.migrations[migration.id] = migration
        notice = engine_ops.notice(tracked.rid)
        if not self.engine.detach(tracked.rid, notice):
            self._settle(migration, "failed", error="the request has no stream here any more")
            return migration
        migration.task = loop.create_task(self._run(migration))
        return migration

    # -- the legs ------------------------------------------------------------------------------------------
    def handoff(self, tracked: Tracked, token_ids: list[int], logprobs: list[Any], cached: int) -> Handoff:
        """The first leg's last word: where its client got to, and what the window leg is to name."""
        migration = tracked.migration
        assert migration is not None
        migration.prefix = (token_ids, logprobs)
        return Handoff(migration_id=migration.id, token=migration.token, to=migration.to, mode=migration.mode,
                       cursor=len(token_ids), output_token_ids=token_ids, num_cached_tokens=cached)

    def window(self, migration_id: str, token: str, to: str | None) -> Migration:
        """The gateway came back for the rest of the request (and says where it goes: `to`)."""
        migration = self.migrations.get(migration_id)
        if migration is None or not secrets.compare_digest(migration.token, token):
            raise MigrationError(404, "no such migration here (unknown id or wrong token)")
        if migration.window.done():
            raise MigrationError(409, "the window of this migration was opened already")
        migration.tracked.tagged = migration.tracked.stream
        migration.window.set_result(to)
        return migration

    def abandon(self, migration_id: str, token: str) -> bool:
        """The gateway will not come back for the request (its client left): end it now, and its migration."""
        migration = self.migrations.get(migration_id)
        if migration is None or not secrets.compare_digest(migration.token, token):
            return False
        self.engine.abort(migration.tracked.rid)
        if migration.task is not None and not migration.task.done():
            migration.task.cancel()
        return True

    def handed_over(self, tracked: Tracked) -> HandedOver:
        assert tracked.migration is not None and tracked.migration.handed_over is not None
        return tracked.migration.handed_over

    # -- the copy ------------------------------------------------------------------------------------------
    async def _run(self, m: Migration) -> None:
        try:
            to = await asyncio.wait_for(m.window, self.settings.attach_timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            self.engine.abort(m.tracked.rid)  # nobody came back for it: its client is gone
            self._settle(m, "failed", error="the gateway did not come back for the request")
            return
        if to is None:
            self._settle(m, "no_target", error="no decode instance could take it; it finishes here")
            return
        started = time.monotonic()
        try:
            to = await self.check_target(to)
            await self._move(m, to)
        except asyncio.CancelledError:
            await self.targets.abandon(to, m.id, m.token, "the request ended on the source")
            self._settle(m, "failed", to=to, error="the request ended before its handover")
        except (MigrationError, SourceGone) as exc:
            await self.targets.abandon(to, m.id, m.token, str(exc))
            outcome = "finished_first" if isinstance(exc, SourceGone) else "failed"
            log.warning("migration of %s to %s did not happen (%s); it runs on here", m.tracked.request_id, to, exc)
            self._settle(m, outcome, to=to, error=str(exc))
        else:
            log.info("request %s moved to %s in %.3f s", m.tracked.request_id, to, time.monotonic() - started)

    async def _move(self, m: Migration, to: str) -> None:
        if m.mode == "recompute":
            await self._hand_over_tokens(m, to)
            return
        first, stage, unconverged, bulk = 0, 0, 0, -1
        pace = Pace(m.rate_bytes_per_s, self.agent.rt.regions.block_bytes)
        while m.mode == "live" and unconverged < MAX_STAGES:
            limit = pace.stage_blocks()
            pinned = await self.engine.call(lambda e: engine_ops.pin_filled(e, m.tracked.rid, first, limit))
            if pinned is None:
                raise SourceGone("the request ended while its KV was being copied")
            try:
                if pinned.blocks:
                    await self._stage(m, to, stage, pinned, None)
            finally:
                await self._release(pinned)
            bulk = pinned.filled if bulk < 0 else bulk  # what was filled when the move began
            stage, first = stage + 1, pinned.end_block
            await pace.after(len(pinned.blocks))
            if limit and len(pinned.blocks) == limit and first < bulk:
                continue  # more of the first bulk to copy, at its pace
            # Past it, a full stage means the request fills blocks as fast as the pace copies them: such stages
            # count toward the limit, after which the request stops and its last stage carries the rest.
            unconverged += 1
            if len(pinned.blocks) <= FINAL_BLOCKS:
                break
        await self._final(m, to, stage, first)

    async def _final(self, m: Migration, to: str, stage: int, first: int) -> None:
        """Stop the request after a step, hand the target its last blocks and its state, and end it here."""
        paused = await self._pause(m, first)
        stopped = time.monotonic()
        pinned, state = paused
        state.request_id = m.tracked.request_id
        try:
            await self._stage(m, to, stage, pinned, state)
        except BaseException:
            await self.engine.call(lambda e: engine_ops.resume(e, m.tracked.rid))
            raise
        finally:
            await self._release(pinned)
        m.handed_over = HandedOver(migration_id=m.id, token=m.token, to=to)
        self.engine.abort(m.tracked.rid, RequestStatus.FINISHED_MIGRATED)
        self._settle(m, "handed_over", to=to, stop_s=time.monotonic() - stopped, stages=stage + 1)

    async def _hand_over_tokens(self, m: Migration, to: str) -> None:
        """Recompute mode: no KV moves; the target recomputes the request from its tokens."""
        paused = await self._pause(m, 0)
        pinned, state = paused
        await self._release(pinned)
        m.handed_over = HandedOver(migration_id=m.id, token=m.token, to=to, recompute=True,
                                   output_token_ids=state.output_token_ids, logprobs=state.logprobs)
        self.engine.abort(m.tracked.rid, RequestStatus.FINISHED_MIGRATED)
        self._settle(m, "handed_over", to=to)

    async def _pause(self, m: Migration, first: int) -> tuple[Pinned, RequestState]:
        """Between two decode steps (a request computing a prompt chunk is waited for, briefly)."""
        deadline = time.monotonic() + self.settings.pause_wait_s
        while True:
            paused = await self.engine.call(lambda e: engine_ops.pause(e, m.tracked.rid, first))
            if paused is not None:
                return paused
            if not await self.engine.call(lambda e: engine_ops.is_running(e, m.tracked.rid)):
                raise SourceGone("the request ended before it could be stopped")
            if time.monotonic() > deadline:
                raise MigrationError(409, "the request did not reach a decode step to stop after")
            await asyncio.sleep(0.002)

    async def _stage(self, m: Migration, to: str, stage: int, pinned: Pinned, final: RequestState | None) -> None:
        key = f"{m.id}:{stage}"
        producer = self.agent.pull_producer
        producer.hold(key, m.read_token, pinned.block_ids, prompt_hash=prompt_hash(pinned.token_ids))
        message = CopyStage(migration_id=m.id, token=m.token, source=self.identity, key=key,
                            read_token=m.read_token, first_block=pinned.first_block, block_ids=pinned.block_ids,
                            token_ids=pinned.token_ids, final=final)
        try:
            await self.targets.stage(to, message, self.settings.stage_timeout_s)
        finally:
            if producer.is_held(key):  # the target's read-done ends it; a failed stage leaves it to us
                producer.end(key, m.read_token)

    async def _release(self, pinned: Pinned) -> None:
        await asyncio.shield(self.engine.call(lambda e: engine_ops.release(e, pinned.blocks)))

    def _settle(self, m: Migration, outcome: str, to: str | None = None, error: str = "", stop_s: float = 0.0,
                stages: int = 0) -> None:
        if m.handed_over is None:  # it stays here, and may move again later
            self.migrations.pop(m.id, None)
            m.tracked.migration = None
        if not m.done.done():
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            m.done.set_result(MigrateResult(request_id=m.tracked.request_id, outcome=outcome, to=to, error=error,
                                            stop_s=stop_s, stages=stages))
