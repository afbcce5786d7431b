"""What migration asks of an engine, run on its thread between two steps (through `AsyncEngine.call`).

On the source: pin the blocks a request filled so far (they stay valid for a reader whatever the request does
meanwhile), stop the request after a step and export it, or let it run on. On the target: reserve blocks for KV
that arrives before its request, then adopt the request with them (or, with none, recompute its tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.engine.block_pool import KVBlock
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.output_processor import RequestOutput
from pdserve.engine.request import Request, RequestStatus, TokenLogprobs
from pdserve.ids import ReqId
from pdserve.migration.wire import MIGRATING, Logprob, MigrationError, RequestState
from pdserve.telemetry.timeline import Timeline
from pdserve.utils import cdiv


@dataclass(slots=True)
class Pinned:
    """Blocks [first_block, first_block + len(blocks)) of a request, pinned, and the tokens whose KV they hold."""

    blocks: list[KVBlock]
    first_block: int
    token_ids: list[int]
    filled: int = 0  # the request's full blocks when these were pinned (more than pinned under a limit)

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def end_block(self) -> int:
        return self.first_block + len(self.blocks)


def pin_filled(engine: LLMEngine, rid: ReqId, first_block: int, limit: int = 0) -> Pinned | None:
    """The request's full blocks from `first_block` on, at most `limit` of them if set (their KV never changes
    again: none while it waits or recomputes after a preemption); None if it ended."""
    request = engine.scheduler.requests.get(rid)
    if request is None or request.is_finished:
        return None
    if request.status != RequestStatus.RUNNING:
        return Pinned([], first_block, [])
    filled = request.num_computed_tokens // engine.kv.block_size
    end = min(filled, first_block + limit) if limit else filled
    blocks = engine.kv.pin(rid, first_block, end)
    return Pinned(blocks, first_block, request.all_token_ids()[:end * engine.kv.block_size], filled)


def release(engine: LLMEngine, blocks: list[KVBlock]) -> None:
    engine.kv.release_blocks(blocks)


def pause(engine: LLMEngine, rid: ReqId, first_block: int) -> tuple[Pinned, RequestState] | None:
    """Stop the request after its last step and pin the rest of its KV, the partly filled last block included;
    None if it is not between two decode steps (it finished, or is computing a prompt)."""
    request = engine.scheduler.pause(rid)
    if request is None:
        return None
    computed = request.num_computed_tokens
    blocks = engine.kv.pin(rid, first_block, cdiv(computed, engine.kv.block_size))
    return Pinned(blocks, first_block, request.all_token_ids()[:computed]), export(engine, request)


def resume(engine: LLMEngine, rid: ReqId) -> None:
    request = engine.scheduler.requests.get(rid)
    if request is not None:
        engine.scheduler.resume(request)


def export(engine: LLMEngine, request: Request) -> RequestState:
    return RequestState(
        external_id=request.external_id, prompt_token_ids=list(request.prompt_token_ids),
        output_token_ids=list(request.output_token_ids),
        logprobs=[Logprob(lp.token_id, lp.logprob, lp.rank, list(lp.top_ids), list(lp.top_logprobs))
                  for lp in request.output_logprobs],
        sampling=request.sampling_params, num_cached_tokens=max(request.num_cached_tokens, 0),
        generator_state=engine.runner.generator_state(request.request_id))


def reserve(engine: LLMEngine, num_blocks: int) -> list[KVBlock]:
    blocks = engine.kv.reserve(num_blocks)
    if blocks is None:
        raise MigrationError(503, f"the target has no room for {num_blocks} more KV blocks")
    return blocks


def check_state(engine: LLMEngine, state: RequestState) -> None:
    """A state from another instance is a client's input: refused whole (MigrationError 400) if unusable here."""
    try:
        engine.check_prompt(state.prompt_token_ids)
        state.sampling.validate(engine.vocab_size)
    except ValueError as exc:
        raise MigrationError(400, f"the migrated request cannot run here: {exc}") from exc
    if any(not 0 <= t < engine.vocab_size for t in state.output_token_ids):
        raise MigrationError(400, "the migrated request has output token ids outside the vocabulary")
    if state.logprobs and len(state.logprobs) != len(state.output_token_ids):
        raise MigrationError(400, "the migrated request has logprobs for some of its tokens only")
    if len(state.prompt_token_ids) + len(state.output_token_ids) >= engine.max_seq_len:
        raise MigrationError(400, "the migrated request is longer than this instance runs")


def adopt(engine: LLMEngine, rid: ReqId, state: RequestState, blocks: list[KVBlock], computed: int,
          timeline: Timeline | None = None) -> None:
    """Run the request here from where it stopped: its first `computed` tokens' KV in `blocks` (none: it
    recomputes them), its random stream restored exactly, or replayed from its seed when only tokens came."""
    check_state(engine, state)
    request = Request(request_id=rid, prompt_token_ids=list(state.prompt_token_ids), sampling_params=state.sampling,
                      eos_token_ids=engine.eos_token_ids, external_id=state.external_id, timeline=timeline)
    request.output_token_ids = list(state.output_token_ids)
    request.output_logprobs = [TokenLogprobs(lp.token_id, lp.logprob, lp.rank, list(lp.top_ids),
                                             list(lp.top_logprobs)) for lp in state.logprobs]
    if state.sampling.logprobs is not None and not state.logprobs:
        # A stream's client has these tokens' logprobs already: they keep the places of the ones to come.
        request.output_logprobs = [TokenLogprobs(t, 0.0, 0, [], []) for t in state.output_token_ids]
    request.num_cached_tokens = state.num_cached_tokens
    request.first_token_time = request.last_token_time = time.monotonic()  # its first token was the source's
    request.mark("migrated_in", tokens=computed)
    if blocks:
        request.num_computed_tokens = computed
        engine.kv.adopt(rid, blocks)
        engine.kv.cache_blocks(request, computed)
    params = state.sampling
    if params.seed is not None:
        draws = 0 if params.is_greedy or state.generator_state is not None else request.num_output_tokens
        engine.runner.restore_generator(rid, params.seed, state.generator_state, draws)
    engine.output.restore(request)
    engine.scheduler.adopt(request)


def is_running(engine: LLMEngine, rid: ReqId) -> bool:
    request = engine.scheduler.requests.get(rid)
    return request is not None and not request.is_finished


def notice(rid: ReqId) -> RequestOutput:
    """What ends a request's current stream when it starts to move (it runs on, for the window leg)."""
    return RequestOutput(request_id=rid, new_token_ids=[], new_text="", new_logprobs=[], finished=True,
                         finish_reason=MIGRATING)
