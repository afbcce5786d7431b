"""Invariances of the engine: what a request produces must not depend on how it was scheduled.

No reference implementation here: pdserve is compared with itself under another batch composition, chunk size,
prefix-cache state or memory pressure. Greedy tokens must be identical and logprobs equal within LOGPROB_TOL
(batching changes GEMM shapes, so bitwise equality is not expected).
"""

from __future__ import annotations

import pytest
from conftest import random_prompt

from pdserve.llm import GenerationResult, SequenceResult
from pdserve.sampling_params import SamplingParams

LOGPROB_TOL = 1e-4
MIXED_LENGTHS = [1, 7, 16, 33, 75, 150]


def greedy(max_tokens: int = 24, logprobs: int | None = 3) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def seeded(seed: int, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=2)


def assert_same_sequence(a: SequenceResult, b: SequenceResult, what: str) -> None:
    assert a.token_ids == b.token_ids, f"{what}: tokens differ"
    assert a.finish_reason == b.finish_reason, what
    assert a.text == b.text, what
    assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids), what
    for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs, strict=True)):
        assert x.token_id == y.token_id and x.rank == y.rank, f"{what}: step {step}"
        assert abs(x.logprob - y.logprob) < LOGPROB_TOL, f"{what}: step {step}: {x.logprob} vs {y.logprob}"
        assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=LOGPROB_TOL), f"{what}: step {step}"


def assert_same_results(a: list[GenerationResult], b: list[GenerationResult], what: str) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert len(x.outputs) == len(y.outputs)
        for j, (s, t) in enumerate(zip(x.outputs, y.outputs, strict=True)):
            assert_same_sequence(s, t, f"{what}: prompt {i} seq {j}")


def run_alone(llm, prompts, params) -> list[GenerationResult]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [llm.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]


def record_plans(engine) -> list:
    """Keep every scheduler plan the engine executes (for checking what a test really exercised)."""
    plans = []
    execute = engine.runner.execute_model

    def recording(plan):
        plans.append(plan)
        return execute(plan)

    engine.runner.execute_model = recording
    return plans


# -- batching ----------------------------------------------------------------------------------------------


def test_mixed_batch_equals_each_request_alone(llama_dir, make_llm) -> None:
    prompts = [random_prompt(n, seed=n) for n in MIXED_LENGTHS]
    # Different output lengths too, so requests finish while others are still prefilling or decoding.
    params = [greedy(max_tokens=8 + 4 * i) for i in range(len(prompts))]
    llm = make_llm(llama_dir, max_num_batched_tokens=64, enable_prefix_caching=False)
    plans = record_plans(llm.engine)
    together = llm.generate(prompts, params)
    # The batch really mixed work: some step ran decodes next to a prefill chunk of another request.
    kinds = [{s.is_decode for s in plan.scheduled} for plan in plans]
    assert {True, False} in kinds
    alone = run_alone(llm, prompts, params)
    assert_same_results(together, alone, "batched vs alone")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_mixed_batch_equals_alone_other_architectures(arch, models, make_llm) -> None:
    prompts = [random_prompt(n, seed=10 + n) for n in (3, 40, 90)]
    llm = make_llm(models(arch), max_num_batched_tokens=48, enable_prefix_caching=False)
    assert_same_results(llm.generate(prompts, greedy()), run_alone(llm, prompts, greedy()), f"{arch} batched")


@pytest.mark.parametrize("chunk", [16, 13])
def test_chunked_prefill_equals_one_shot(chunk, llama_dir, make_llm) -> None:
    prompts = [random_prompt(n, seed=20 + n) for n in (40, 75, 150)]
    one_shot = make_llm(llama_dir, max_num_batched_tokens=512, enable_prefix_caching=False)
    chunked = make_llm(llama_dir, max_num_batched_tokens=chunk, enable_prefix_caching=False)
    # 13 puts chunk boundaries in the middle of blocks; 16 on block boundaries.
    assert_same_results(chunked.generate(prompts, greedy()), one_shot.generate(prompts, greedy()),
                        f"chunk {chunk} vs one shot")


def test_one_shot_prefill_without_chunking_equals_chunked(llama_dir, make_llm) -> None:
    prompts = [random_prompt(n, seed=30 + n) for n in (20, 60)]
    plain = make_llm(llama_dir, max_num_batched_tokens=128, enable_chunked_prefill=False,
                     enable_prefix_caching=False)
    chunked = make_llm(llama_dir, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert_same_results(plain.generate(prompts, greedy()), chunked.generate(prompts, greedy()), "no chunking")


# -- prefix caching ----------------------------------------------------------------------------------------


def test_prefix_cache_hit_equals_cold_run(llama_dir, make_llm) -> None:
    bs = 16
    a = random_prompt(80, seed=40)
    b = a[:48] + random_prompt(30, seed=41)  # shares three full blocks with a
    warm = make_llm(llama_dir, block_size=bs, max_num_batched_tokens=64, enable_prefix_caching=True)
    cold = make_llm(llama_dir, block_size=bs, max_num_batched_tokens=64, enable_prefix_caching=False)

    (first,) = warm.generate([a], greedy())
    assert first.num_cached_tokens == 0
    (hit,) = warm.generate([b], greedy())
    assert hit.num_cached_tokens == 48
    assert_same_results([hit], cold.generate([b], greedy()), "prefix hit vs cold")
    assert cold.generate([b], greedy())[0].num_cached_tokens == 0


@pytest.mark.parametrize("length", [33, 48, 80])
def test_full_prompt_hit_equals_cold_run(length, llama_dir, make_llm) -> None:
    # A repeated prompt reuses all of its full blocks but one token; 33 leaves exactly one token to compute,
    # 48 (a block multiple) must recompute its whole last block.
    prompt = random_prompt(length, seed=50 + length)
    warm = make_llm(llama_dir, max_num_batched_tokens=64)
    cold = make_llm(llama_dir, max_num_batched_tokens=64, enable_prefix_caching=False)
    warm.generate([prompt], greedy())
    (again,) = warm.generate([prompt], greedy())
    assert again.num_cached_tokens == (length - 1) // 16 * 16
    assert_same_results([again], cold.generate([prompt], greedy()), f"repeat of {length}")


def test_prefix_hit_on_generated_tokens_equals_cold_run(llama_dir, make_llm) -> None:
    """A follow-up turn: the new prompt is an old prompt plus its output, whose blocks were cached too."""
    warm = make_llm(llama_dir, max_num_batched_tokens=64)
    cold = make_llm(llama_dir, max_num_batched_tokens=64, enable_prefix_caching=False)
    first = random_prompt(30, seed=60)
    (turn1,) = warm.generate([first], greedy(max_tokens=40))
    follow_up = first + turn1.outputs[0].token_ids + random_prompt(10, seed=61)
    (turn2,) = warm.generate([follow_up], greedy())
    # 30 + 40 tokens, minus the last sampled token which never went through the model: 69 -> 4 full blocks.
    assert turn2.num_cached_tokens == 64
    assert_same_results([turn2], cold.generate([follow_up], greedy()), "follow-up turn")


def test_equal_block_after_a_different_prefix_is_not_a_hit(llama_dir, make_llm) -> None:
    """A block's KV depends on everything before it: equal tokens after a different prefix must miss."""
    block = random_prompt(16, seed=65)
    first = random_prompt(16, seed=66) + block + random_prompt(5, seed=67)
    second = random_prompt(16, seed=68) + block + random_prompt(5, seed=67)
    warm = make_llm(llama_dir, max_num_batched_tokens=64)
    cold = make_llm(llama_dir, max_num_batched_tokens=64, enable_prefix_caching=False)
    warm.generate([first], greedy())
    (result,) = warm.generate([second], greedy())
    assert result.num_cached_tokens == 0
    assert_same_results([result], cold.generate([second], greedy()), "different prefix")
    # Both copies of the block are cached now; a third prompt must get the one that follows its own prefix.
    third = second[:32] + random_prompt(7, seed=69)
    (result,) = warm.generate([third], greedy())
    assert result.num_cached_tokens == 32
    assert_same_results([result], cold.generate([third], greedy()), "hit after the second prefix")


def test_concurrent_requests_sharing_a_prefix(llama_dir, make_llm) -> None:
    shared = random_prompt(40, seed=70)
    prompts = [shared + random_prompt(5 + i, seed=71 + i) for i in range(4)]
    warm = make_llm(llama_dir, max_num_batched_tokens=64)
    cold = make_llm(llama_dir, max_num_batched_tokens=64, enable_prefix_caching=False)
    warm.generate([shared + [1, 2, 3]], greedy(max_tokens=2))
    results = warm.generate(prompts, greedy())
    assert all(r.num_cached_tokens == 32 for r in results)
    assert_same_results(results, run_alone(cold, prompts, greedy()), "shared prefix")


# -- preemption --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_requests_equal_unpreempted(prefix_caching, llama_dir, make_llm) -> None:
    prompts = [random_prompt(20 + 7 * i, seed=80 + i) for i in range(4)]
    # Greedy and seeded sampling: a preempted seeded request must continue its own random stream.
    params = [greedy(max_tokens=40), seeded(5, max_tokens=40), greedy(max_tokens=36),
              seeded(6, max_tokens=44)]
    roomy = make_llm(llama_dir, max_num_batched_tokens=64, enable_prefix_caching=prefix_caching)
    # Each request needs 4-5 blocks at its longest; 10 blocks hold two of them, so the scheduler must preempt.
    tight = make_llm(llama_dir, max_num_batched_tokens=64, num_kv_blocks=10,
                     enable_prefix_caching=prefix_caching)
    expected = run_alone(roomy, prompts, params)
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert roomy.engine.scheduler.num_preemptions == 0
    assert_same_results(got, expected, "preempted vs unpreempted")


def test_preemption_with_shared_prefix_blocks_and_chunked_prefill(llama_dir, make_llm) -> None:
    """Victims that share prefix-cache blocks with survivors, preempted mid-prefill or mid-decode."""
    shared = random_prompt(32, seed=85)
    prompts = [shared + random_prompt(10 + 9 * i, seed=86 + i) for i in range(4)]
    params = [greedy(max_tokens=30), seeded(8, max_tokens=34), greedy(max_tokens=26),
              seeded(9, max_tokens=30)]
    roomy = make_llm(llama_dir, max_num_batched_tokens=24, enable_prefix_caching=False)
    tight = make_llm(llama_dir, max_num_batched_tokens=24, num_kv_blocks=11)
    expected = run_alone(roomy, prompts, params)
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert_same_results(got, expected, "preempted with shared blocks")


def run_bounded(engine, max_steps: int) -> list:
    """Step until idle, failing (instead of hanging) if the engine stops making progress."""
    finished = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        finished += [o for o in engine.step() if o.finished]
    raise AssertionError(f"still busy after {max_steps} steps: {engine.stats()}")


def test_sequence_outgrowing_the_whole_kv_cache_is_length_capped(llama_dir, make_llm) -> None:
    # 4 blocks of 16 hold 64 tokens, far below max_model_len: the request must end there, not wait forever.
    llm = make_llm(llama_dir, num_kv_blocks=4, max_num_batched_tokens=32)
    engine = llm.engine
    rid = engine.add_request("long", random_prompt(20, seed=100), greedy(max_tokens=100, logprobs=None))
    (out,) = run_bounded(engine, 200)
    assert out.request_id == rid and out.finish_reason == "length"
    assert out.num_prompt_tokens + out.num_output_tokens == 4 * 16
    with pytest.raises(ValueError, match="64 tokens"):
        engine.add_request("too-long", random_prompt(64, seed=101), greedy())


def test_prompt_over_the_step_budget_without_chunked_prefill_is_refused(llama_dir, make_llm) -> None:
    llm = make_llm(llama_dir, max_num_batched_tokens=32, enable_chunked_prefill=False)
    engine = llm.engine
    with pytest.raises(ValueError, match="32 tokens"):
        engine.add_request("too-long", random_prompt(40, seed=102), greedy())
    # A prompt that fits runs; its output is capped where a recompute after preemption would no longer fit.
    rid = engine.add_request("fits", random_prompt(20, seed=103), greedy(max_tokens=100, logprobs=None))
    (out,) = run_bounded(engine, 100)
    assert out.request_id == rid and out.finish_reason == "length" and out.num_output_tokens == 12


# -- seeded sampling ---------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_across_instances_and_batches(llama_dir, make_llm) -> None:
    prompt = random_prompt(25, seed=90)
    alone = make_llm(llama_dir).generate([prompt], seeded(123))[0].outputs[0]
    again = make_llm(llama_dir).generate([prompt], seeded(123))[0].outputs[0]
    assert_same_sequence(alone, again, "second instance")

    # The same request among neighbours: unseeded sampled ones (which draw from the shared generator),
    # greedy ones, and another seeded one, submitted before and after it.
    others = [random_prompt(n, seed=91 + n) for n in (5, 60, 33)]
    prompts = [others[0], others[1], prompt, others[2]]
    params = [SamplingParams(temperature=1.0, max_tokens=30), seeded(7), seeded(123), greedy()]
    batched = make_llm(llama_dir, max_num_batched_tokens=32).generate(prompts, params)
    assert_same_sequence(batched[2].outputs[0], alone, "in a batch")

    different = make_llm(llama_dir).generate([prompt], seeded(124))[0].outputs[0]
    assert different.token_ids != alone.token_ids
    # Sampling really happened: a seeded run is not just the greedy continuation.
    assert alone.token_ids != make_llm(llama_dir).generate([prompt], greedy())[0].outputs[0].token_ids


def test_seeded_request_draws_fresh_randomness_every_step(llama_dir, make_llm) -> None:
    # At a very high temperature the distribution is nearly uniform over 4099 tokens, so a request that reused
    # the same random numbers every step would keep picking the same token.
    params = SamplingParams(temperature=50.0, seed=123, max_tokens=16, ignore_eos=True)
    tokens = make_llm(llama_dir).generate([random_prompt(8, seed=94)], params)[0].outputs[0].token_ids
    assert len(set(tokens)) >= 12


def test_n_samples(llama_dir, make_llm) -> None:
    llm = make_llm(llama_dir)
    prompt = random_prompt(12, seed=95)
    params = SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=123, max_tokens=16, ignore_eos=True)
    (result,) = llm.generate([prompt], params)
    assert len(result.outputs) == 3
    assert all(len(s.token_ids) == 16 and s.finish_reason == "length" for s in result.outputs)
    assert len({tuple(s.token_ids) for s in result.outputs}) == 3
    (repeat,) = make_llm(llama_dir).generate([prompt], params)
    assert [s.token_ids for s in repeat.outputs] == [s.token_ids for s in result.outputs]
    # Unseeded n=3 also gives three distinct sequences.
    (unseeded,) = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, max_tokens=16, ignore_eos=True))
    assert len({tuple(s.token_ids) for s in unseeded.outputs}) == 3


# -- abort -------------------------------------------------------------------------------------------------


def test_abort_mid_generation_frees_all_blocks(llama_dir, make_llm, assert_no_blocks_in_use) -> None:
    llm = make_llm(llama_dir, max_num_batched_tokens=32, max_num_seqs=2)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    decoding = engine.add_request("decoding", random_prompt(20, seed=96), seeded(3, max_tokens=100))
    prefilling = engine.add_request("prefilling", random_prompt(150, seed=97), params)
    waiting = engine.add_request("waiting", random_prompt(10, seed=98), params)  # held back by max_num_seqs
    survivor = engine.add_request("survivor", random_prompt(10, seed=99), SamplingParams(temperature=0.0,
                                                                                         max_tokens=5))
    for _ in range(4):
        engine.step()
    assert engine.kv.block_ids(decoding) and engine.kv.block_ids(prefilling)
    assert decoding in engine.runner.generators  # its own seeded generator, to be dropped with it
    assert engine.scheduler.requests[prefilling].num_computed_tokens < 150  # still mid-prefill
    used_before = engine.kv.num_used_blocks
    outputs = engine.abort_request(decoding)
    assert [o.finish_reason for o in outputs] == ["abort"]
    assert engine.kv.num_used_blocks < used_before
    engine.abort_request(prefilling)
    engine.abort_request(waiting)
    engine.abort_request(waiting)  # aborting twice is harmless
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.finish_reason) for o in finished] == [(survivor, "length")]
    assert_no_blocks_in_use(engine)
    assert not engine.runner.generators
