"""An instance's migration, as its server sees it: which legs may move, the markers that end them, and the legs
a gateway sends after a marker (the source's window, the target's attach, a resume by recompute anywhere).

A leg after a marker goes on from `cursor`, the outputs its client has: outputs between the cursor and the
request's `split` (where the previous leg stopped) come first, as one catch-up output, then the request's own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.output_processor import RequestOutput, sent_text
from pdserve.engine.request import TokenLogprobs
from pdserve.ids import ReqId
from pdserve.migration.client import TargetClient
from pdserve.migration.settings import MigrationSettings
from pdserve.migration.source import MigrationSource, Tracked
from pdserve.migration.target import MigrationTarget
from pdserve.migration.wire import (MIGRATING, Continue, Logprob, MigrateRequest, MigrationError, RequestState,
                                    Source, TargetStatus, encode, parse_continue)
from pdserve.sampling_params import SamplingParams
from pdserve.telemetry.timeline import TimelineStore
from pdserve.tokenizer import Tokenizer

if TYPE_CHECKING:  # the data planes it names load transfer engines that start threads: imported where used
    from pdserve.kv_transfer.factory import ConnectorBundle

log = logging.getLogger(__name__)
MOVED = (MIGRATING, "migrated")  # finish reasons that end a leg with a marker, not the request


@dataclass(eq=False)
class Leg:
    """One leg of a request that may move: the server asks it for the marker that ends the leg, and says when
    the leg ended."""

    tracked: Tracked
    source: MigrationSource
    moved: bool = False
    registered: bool = False

    @property
    def tagged(self) -> bool:
        return self.tracked.tagged

    def marker(self, out: RequestOutput, token_ids: list[int], logprobs: list[TokenLogprobs]) -> bytes:
        """The marker that ends this leg (`out` is the output that says the request moves or moved)."""
        self.moved = True
        if out.finish_reason == MIGRATING:
            wire_logprobs = [Logprob(lp.token_id, lp.logprob, lp.rank, lp.top_ids, lp.top_logprobs)
                             for lp in logprobs]
            handoff = self.source.handoff(self.tracked, list(token_ids), list(logprobs), out.num_cached_tokens)
            handoff.logprobs = wire_logprobs
            return encode(handoff)
        return encode(self.source.handed_over(self.tracked))

    def start(self) -> None:
        """The leg is being served: from now on its request may be asked to move."""
        if not self.registered:
            self.registered = True
            self.source.register(self.tracked)

    def close(self) -> None:
        if self.registered:
            self.source.leg_ended(self.tracked, self.moved)


@dataclass(slots=True)
class Opened:
    """A leg after a marker: what its client has (the prefix) and the outputs it sends from there."""

    leg: Leg
    rid: ReqId
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    text: str
    outputs: AsyncIterator[RequestOutput]


class Migrations:
    def __init__(self, engine: AsyncEngine, bundle: ConnectorBundle, tokenizer: Tokenizer, role: str,
                 model_name: str, timelines: TimelineStore, headers: list[tuple[bytes, bytes]]) -> None:
        agent = bundle.agent
        settings = MigrationSettings.for_lease(agent.config.lease_s, agent.config.migration_bytes_per_s)
        self.engine = engine
        self.tokenizer = tokenizer
        self.role = role
        self.model_name = model_name
        self.bundle = bundle
        self.targets = TargetClient(headers)
        identity = Source(bundle.engine_id, agent.config.host, agent.port)
        self.source = MigrationSource(engine, agent, identity, self.targets, settings)
        self.target = MigrationTarget(engine, agent, settings, engine.engine.kv.block_size, timelines)
        self.draining = ""  # why this instance takes no migrations now ("": it takes them)
        self.target.refusal = self.refusal
        self._reaper: asyncio.Task | None = None

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self.target.reap())

    def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        self.targets.close()

    def refusal(self) -> str:
        if self.role != "decode":
            return f"it is a {self.role} instance, not a decode instance"
        return self.draining

    def status(self) -> TargetStatus:
        layout = self.bundle.agent.config.layout
        words = f"{self.model_name}, {layout.dtype}, blocks of {layout.block_size}" if layout else self.model_name
        reason = self.refusal()
        return TargetStatus(accepting=not reason, reason=reason, engine_id=self.bundle.engine_id, role=self.role,
                            model=self.model_name, compat_hash=self.bundle.agent.config.compat_hash, layout=words)

    def metrics(self) -> dict[str, float]:
        out = {f"counter pdserve:migrations_out_{outcome}": n for outcome, n in self.source.outcomes.items()}
        out.update({"counter pdserve:migrations_in_taken_over": self.target.taken_over,
                    "counter pdserve:migrations_in_resumed": self.target.resumed,
                    "gauge pdserve:migration_blocks_reserved": self.target.num_held()})
        return out

    async def hand_off(self, drain: Any, deadline: float) -> None:
        """A draining decode instance's hand-off: move every request that can move to other decode instances (the
        gateway relaying each picks where), and let the others finish here, by `deadline` (time.monotonic())."""
        self.draining = "it is draining"
        while time.monotonic() < deadline:
            movable = [t for t in self.source.tracked.values() if t.migration is None]
            if movable:
                ask = MigrateRequest(count=len(movable))
                try:
                    results = await asyncio.wait_for(self.source.migrate(ask), max(deadline - time.monotonic(), 0))
                except TimeoutError:
                    return
                log.info("drain: %d requests moved, %d finish here", sum(r.outcome == "handed_over" for r in results),
                         sum(r.outcome != "handed_over" for r in results))
            if not drain.running():
                return
            await asyncio.sleep(0.05)

    # -- the server's hooks ----------------------------------------------------------------------------------
    def track(self, request_id: str, rid: ReqId, stream: bool) -> Leg:
        return Leg(Tracked(request_id, rid, stream), self.source)

    @staticmethod
    def continuation(params: Any) -> Continue | None:
        return parse_continue(params)

    async def open(self, cont: Continue, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                   external_id: str, stream: bool) -> Opened:
        """The leg a gateway sends after a marker; MigrationError (a 4xx) if it names nothing this instance has."""
        if cont.phase == "window":
            migration = self.source.window(cont.migration_id, cont.token, cont.to)
            leg, rid = Leg(migration.tracked, self.source, registered=True), migration.tracked.rid
            outputs, logprobs = migration.prefix
        else:
            if cont.phase == "attach":
                rid, state = await self.target.attach(cont.migration_id, cont.token)
                prompt_token_ids, params = state.prompt_token_ids, state.sampling
            else:
                state = await self._resume(cont, request_id, prompt_token_ids, params, external_id)
                rid = await self.target.resume(state)
            outputs, logprobs = state.output_token_ids, token_logprobs(state.logprobs)
            leg = self.track(request_id, rid, stream)
        cursor = min(cont.cursor, len(outputs))
        text = sent_text(self.tokenizer, prompt_token_ids, outputs[:cursor], params)
        catch_up = None
        if cursor < len(outputs):
            rest = sent_text(self.tokenizer, prompt_token_ids, outputs, params)
            catch_up = RequestOutput(request_id=rid, new_token_ids=outputs[cursor:], new_text=rest[len(text):],
                                     new_logprobs=logprobs[cursor:], finished=False)
        try:
            outputs_after = self.engine.attach(rid)
        except KeyError:
            leg.close()
            raise MigrationError(410, "the request ended before its client came back for it") from None
        return Opened(leg, rid, outputs[:cursor], logprobs[:cursor], text, _after(catch_up, outputs_after))

    async def _resume(self, cont: Continue, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      external_id: str) -> RequestState:
        if self.refusal():
            raise MigrationError(409, f"this instance takes no migrations now: {self.refusal()}")
        return RequestState(request_id=request_id, external_id=external_id, prompt_token_ids=prompt_token_ids,
                            output_token_ids=cont.output_token_ids, logprobs=cont.logprobs, sampling=params,
                            num_cached_tokens=cont.num_cached_tokens)


def token_logprobs(logprobs: list[Logprob]) -> list[TokenLogprobs]:
    return [TokenLogprobs(lp.token_id, lp.logprob, lp.rank, list(lp.top_ids), list(lp.top_logprobs))
            for lp in logprobs]


async def _after(first: RequestOutput | None, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    try:
        if first is not None:
            yield first
        async for out in rest:
            yield out
    finally:
        await rest.aclose()  # aborts the request if its consumer left before it finished


