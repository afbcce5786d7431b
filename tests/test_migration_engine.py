"""Migration at the engine: a request stopped after a step on one engine, its KV blocks copied and its state adopted
by another, goes on exactly as if it had never moved (greedy and seeded sampling, penalties, stop strings, logprobs);
so does one adopted with its tokens alone (recompute, its seeded random stream replayed); and neither engine holds a
block afterwards. The oracle is the same request run start to end on a third engine."""

from __future__ import annotations

import pytest

from conftest import assert_no_blocks_in_use, random_prompt
from pdserve.engine.request import RequestStatus
from pdserve.ids import ReqId
from pdserve.migration import engine_ops
from pdserve.migration.source import Pace
from pdserve.sampling_params import SamplingParams

PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True, logprobs=1,
                             frequency_penalty=0.5, repetition_penalty=1.2),
    "stop strings": SamplingParams(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True, stop=["e", "t h"],
                                   min_tokens=30),
}


@pytest.fixture(scope="module")
def engines(models):
    from conftest import DEFAULT_ENGINE_KWARGS
    from pdserve.llm import LLM

    made = [LLM(str(models("llama")), **{**DEFAULT_ENGINE_KWARGS, "max_num_batched_tokens": 32}) for _ in range(3)]
    yield made
    for llm in made:
        assert_no_blocks_in_use(llm.engine)


def run_until(engine, rid: ReqId, outputs: int, got: dict) -> None:
    """Step until the request has `outputs` tokens or finished."""
    finished = False
    while len(got["tokens"]) < outputs and not finished:
        for out in engine.step():
            if out.request_id == rid:
                got["tokens"] += out.new_token_ids
                got["text"] += out.new_text
                got["logprobs"] += [lp.logprob for lp in out.new_logprobs]
                finished = out.finished


def move(source, target, rid: ReqId, recompute: bool) -> ReqId:
    """Stop the request on `source` after its step, copy its KV (or not) and adopt it on `target`."""
    pinned, state = engine_ops.pause(source, rid, 0)
    blocks = [] if recompute else engine_ops.reserve(target, len(pinned.blocks))
    if recompute:
        state.generator_state = None  # only the tokens came: the random stream is replayed from the seed
    else:
        for src, dst in zip(pinned.block_ids, [b.block_id for b in blocks], strict=True):
            target.runner.kv_cache[dst].copy_(source.runner.kv_cache[src])
    moved = ReqId(f"moved-{rid}")
    engine_ops.adopt(target, moved, state, blocks, len(pinned.token_ids))
    engine_ops.release(source, pinned.blocks)
    (last,) = source.abort_request(rid, RequestStatus.FINISHED_MIGRATED)
    assert last.finish_reason == "migrated" and last.new_text == "", "a moved request sends nothing more here"
    return moved


@pytest.mark.parametrize("recompute", [False, True], ids=["with its KV", "recomputed"])
@pytest.mark.parametrize("kind", PARAMS)
def test_moved_request_goes_on_exactly(engines, kind, recompute):
    source, target, oracle = (llm.engine for llm in engines)
    params = PARAMS[kind]
    prompt = random_prompt(45, seed=len(kind))
    expected = engines[2].generate([prompt], params)[0].outputs[0]
    rid = source.add_request("moving", prompt, params)
    got = {"tokens": [], "text": "", "logprobs": []}
    run_until(source, rid, 17, got)
    assert len(got["tokens"]) == 17, "the request must still be running to move"
    moved = move(source, target, rid, recompute)
    run_until(target, moved, params.max_tokens, got)
    source.step()
    target.step()  # the runners drop the finished requests' per-request state
    assert got["tokens"] == expected.token_ids
    assert got["text"] == expected.text
    if params.logprobs is not None:
        # Recomputed, the generated tokens' KV comes from the prefill kernel instead of the decode steps': the
        # bound between two kernels over the same sums, as elsewhere in the suite, not the bit-equal copy's.
        tol = 1e-4 if recompute else 1e-5
        assert got["logprobs"] == pytest.approx([lp.logprob for lp in expected.logprobs], abs=tol)
    for engine in (source, target, oracle):
        assert_no_blocks_in_use(engine)


def test_pinned_blocks_outlive_their_request(engines):
    """A reader's blocks stay out of the free pool while pinned, even after their request ended."""
    source = engines[0].engine
    rid = source.add_request("pinned", random_prompt(40, seed=9), PARAMS["greedy"])
    run_until(source, rid, 3, {"tokens": [], "text": "", "logprobs": []})
    pinned = engine_ops.pin_filled(source, rid, 0)
    assert len(pinned.blocks) == 2 and pinned.token_ids == source.scheduler.requests[rid].all_token_ids()[:32]
    source.abort_request(rid)
    assert source.kv.num_used_blocks == 2
    engine_ops.release(source, pinned.blocks)
    assert_no_blocks_in_use(source)


def test_a_paced_stage_pins_at_most_its_share_of_the_filled_blocks(engines):
    source = engines[0].engine
    rid = source.add_request("paced", random_prompt(70, seed=3), PARAMS["greedy"])
    run_until(source, rid, 3, {"tokens": [], "text": "", "logprobs": []})
    first = engine_ops.pin_filled(source, rid, 0, limit=3)
    rest = engine_ops.pin_filled(source, rid, first.end_block, limit=3)
    assert (first.first_block, len(first.blocks), rest.first_block, len(rest.blocks)) == (0, 3, 3, 1)
    assert first.filled == rest.filled == 4  # what the request had filled, beyond the limit: the bulk to copy
    assert rest.token_ids == source.scheduler.requests[rid].all_token_ids()[:64]
    source.abort_request(rid)
    engine_ops.release(source, first.blocks + rest.blocks)
    assert_no_blocks_in_use(source)


def test_a_pace_bounds_each_stage_and_waits_until_the_bytes_sent_are_due():
    now = [10.0]
    pace = Pace(rate=4 * 1024 * 1024, block_bytes=64 * 1024, clock=lambda: now[0])
    assert pace.stage_blocks() == 6  # a tenth of a second's 4 MiB/s, in whole 64 KiB blocks
    assert pace.wait_after(6) == pytest.approx(6 * 64 / 4096)  # sent at once: due 94 ms after the start
    now[0] += 1.0
    assert pace.wait_after(6) == 0.0  # a slow stage: nothing more to wait for
    unpaced = Pace(rate=0.0, block_bytes=64 * 1024, clock=lambda: now[0])
    assert (unpaced.stage_blocks(), unpaced.wait_after(1000)) == (0, 0.0)


def test_a_request_mid_prompt_is_not_paused(engines):
    source = engines[0].engine
    rid = source.add_request("prefilling", random_prompt(100, seed=4), PARAMS["greedy"])
    source.step()  # one 32-token chunk of 100
    assert engine_ops.pause(source, rid, 0) is None
    source.abort_request(rid)
    source.step()
    assert_no_blocks_in_use(source)


def test_a_lease_bound_to_a_sequence_is_granted_only_to_a_reader_naming_it():
    """A migration's lease names the token ids its blocks hold: a grant asked with any other sequence is refused as
    never granted (the reader's request must fail), whatever its key and token; one naming it gets checksums."""
    import asyncio

    import torch
    import zmq.asyncio

    from pdserve.kv_transfer.agent import AgentConfig, TransferAgent
    from pdserve.kv_transfer.data_plane import make_data_plane
    from pdserve.kv_transfer.messages import ReadGrant
    from pdserve.kv_transfer.params import prompt_hash
    from pdserve.kv_transfer.side_channel import SideChannelClient

    plane = make_data_plane("tcp", "127.0.0.1")
    plane.allocate((4, 2, 2, 2, 16, 8), torch.float32)
    agent = TransferAgent(AgentConfig(engine_id="source", compat_hash="h", planes={"tcp": plane}))
    agent.start()
    tokens = list(range(100, 132))

    async def ask(sequence: list[int]):
        ctx = zmq.asyncio.Context()
        client = SideChannelClient(ctx, "127.0.0.1", agent.port)
        try:
            return await client.request(ReadGrant(key="mig-1:0", token="r" * 32, block_ids=[1, 2],
                                                  prompt_hash=prompt_hash(sequence)), 10)
        finally:
            client.close()
            ctx.term()

    try:
        agent.pull_producer.hold("mig-1:0", "r" * 32, [1, 2], prompt_hash=prompt_hash(tokens))
        refused = asyncio.run(ask(tokens[:-1] + [7]))
        assert not refused.ok and refused.refusal == "denied" and "another sequence" in refused.error
        granted = asyncio.run(ask(tokens))
        assert granted.ok and len(granted.checksums) == 2
    finally:
        agent.stop()
