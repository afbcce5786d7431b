"""Sampling semantics, checked against computations made here, independently of the engine.

Sampler-level tests call `pdserve.engine.sampler.sample` on hand-made logits rows whose answers can be
worked out by hand (which tokens top-p / min-p / top-k keep, what a penalty does to a logit). Engine-level
tests run the tiny llama and check stops, finish reasons, penalties and logprobs against Hugging Face logits
or against an unconstrained pdserve run of the same prompt.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import random_prompt

from pdserve.engine.outputs import ScheduledRequest
from pdserve.engine.sampler import _apply_penalties, first_argmax, sample
from pdserve.ids import ReqId
from pdserve.sampling_params import SamplingParams

NEAR_TIE = 1e-3
# chi-square critical value for 5 degrees of freedom at p = 1e-6; the draws are seeded, so this never flakes.
CHI2_LIMIT_DF5 = 35.9

# A 5-token distribution whose nucleus / min-p / top-k cut-offs are easy to work out by hand.
HAND_PROBS = [0.5, 0.25, 0.15, 0.07, 0.03]


def row(params: SamplingParams, output: list[int] | None = None, prompt: list[int] | None = None,
        eos: tuple[int, ...] = ()) -> ScheduledRequest:
    return ScheduledRequest(request_id=ReqId("r"), token_ids=[0], start_position=0, block_ids=[0],
                            sample=True, sampling_params=params, prompt_token_ids=prompt or [0],
                            output_token_ids=output or [], eos_token_ids=eos)


def draw(logits_row: torch.Tensor, params: SamplingParams, num: int, seed: int = 0) -> torch.Tensor:
    """`num` independent draws from one logits row (one batch row per draw, the shared default generator)."""
    logits = logits_row.to(torch.float32).unsqueeze(0).repeat(num, 1)
    rows = [row(params) for _ in range(num)]
    result = sample(logits, rows, [None] * num, torch.Generator().manual_seed(seed))
    return torch.tensor(result.token_ids)


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token of probability zero"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def hand_logits(probs: list[float] = HAND_PROBS) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log() + 3.0  # a shift changes nothing after softmax


# -- random sampling ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_pick_is_argmax_with_its_tie_rule(dtype) -> None:
    """Greedy's row-wise max picks what torch.argmax picks, ties (the first index) and NaN/-inf rows included."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        x = torch.randint(0, 3, (16, 997), generator=g).to(dtype)  # values from {0, 1, 2}: every row has ties
        assert torch.equal(first_argmax(x), x.argmax(dim=-1))
    odd = torch.full((3, 10), float("-inf"), dtype=dtype)
    odd[1, 4], odd[2, 7] = float("nan"), 1.0
    assert torch.equal(first_argmax(odd), odd.argmax(dim=-1))


def test_temperature_sampling_matches_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temperature = 0.7
    samples = draw(logits, SamplingParams(temperature=temperature), 20000)
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    assert chi_square(samples, expected) < CHI2_LIMIT_DF5
    # The test has the power to see a missing temperature.
    assert chi_square(samples, torch.softmax(logits.double(), dim=-1)) > 10 * CHI2_LIMIT_DF5


def test_seeded_generator_draws_are_reproducible_and_independent_of_neighbours() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=11)
    mine = [torch.Generator().manual_seed(11) for _ in range(2)]
    alone = [sample(logits[:1], [row(params)], [mine[0]], torch.Generator()).token_ids[0] for _ in range(30)]
    others = [row(SamplingParams(temperature=1.0)) for _ in range(3)]
    batched = [sample(logits, [row(params), *others], [mine[1], None, None, None],
                      torch.Generator().manual_seed(step)).token_ids[0] for step in range(30)]
    assert alone == batched
    assert len(set(alone)) > 1


# Expected supports worked out by hand from HAND_PROBS = [.5, .25, .15, .07, .03] (token ids 0..4):
#  top_p keeps a token while the mass of strictly better tokens is below top_p;
#  min_p keeps tokens with p >= min_p * max p (after temperature); top_k keeps the k best;
#  top_k is applied before top_p, which then works on the renormalized survivors.
SUPPORT_CASES = [
    (dict(top_p=0.6), {0, 1}),  # mass before: 0, .5 | .75
    (dict(top_p=0.8), {0, 1, 2}),  # .75 < .8 | .9
    (dict(top_p=0.95), {0, 1, 2, 3}),  # .9 < .95 | .97
    (dict(top_p=1.0), {0, 1, 2, 3, 4}),
    (dict(min_p=0.1), {0, 1, 2, 3}),  # threshold .05
    (dict(min_p=0.2), {0, 1, 2}),  # threshold .1
    (dict(min_p=0.4), {0, 1}),  # threshold .2
    (dict(top_k=2), {0, 1}),
    (dict(top_k=4), {0, 1, 2, 3}),
    (dict(top_k=2, top_p=0.6), {0}),  # survivors .5/.75 = .667, .333: mass before token 1 is .667 >= .6
    # T=2: p ~ sqrt(HAND_PROBS) = [.348, .246, .191, .130, .085]; threshold .5 * .348 = .174.
    (dict(temperature=2.0, min_p=0.5), {0, 1, 2}),
    # T=2 nucleus: mass before: 0, .348, .594 | .785
    (dict(temperature=2.0, top_p=0.7), {0, 1, 2}),
]


@pytest.mark.parametrize(("knobs", "support"), SUPPORT_CASES, ids=[str(c[0]) for c in SUPPORT_CASES])
def test_top_p_min_p_top_k_keep_exactly_the_right_tokens(knobs, support) -> None:
    params = SamplingParams(**{"temperature": 1.0, **knobs})
    logits = hand_logits()
    samples = draw(logits, params, 6000, seed=len(support))
    assert set(samples.tolist()) == support
    # Within the support the draws follow the renormalized tempered distribution.
    probs = torch.softmax(logits / params.temperature, dim=-1)
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[list(support)] = True
    expected = torch.where(mask, probs, 0.0)
    expected /= expected.sum()
    assert chi_square(samples, expected) < CHI2_LIMIT_DF5


# -- penalties ---------------------------------------------------------------------------------------------


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], repetition: float,
                        presence: float, frequency: float) -> torch.Tensor:
    """vLLM / OpenAI definitions, token by token.

    repetition: for tokens in the prompt or the output, positive logits are divided by it, negative ones
    multiplied. frequency / presence: subtract count * frequency and presence (once) for tokens in the output.
    """
    out = logits.double().clone()
    for token in set(prompt) | set(output):
        value = out[token].item()
        out[token] = value / repetition if value > 0 else value * repetition
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


PENALTY_CASES = [(1.0, 0.5, 0.0), (1.0, 0.0, 0.7), (1.0, -0.5, -0.3), (1.5, 0.0, 0.0), (0.7, 0.0, 0.0),
                 (1.3, 0.4, 0.2)]


@pytest.mark.parametrize(("repetition", "presence", "frequency"), PENALTY_CASES)
def test_penalties_change_logits_as_defined(repetition, presence, frequency) -> None:
    generator = torch.Generator().manual_seed(7)
    vocab = 40
    logits = torch.randn(3, vocab, generator=generator) * 3
    prompts = [[1, 2, 3, 3, 30], [5], [7, 8]]
    outputs = [[3, 4, 4, 4, 9, 30], [], [8, 8, 20]]  # overlaps with the prompt, repeats, an empty output
    params = SamplingParams(temperature=0.0, repetition_penalty=repetition, presence_penalty=presence,
                            frequency_penalty=frequency)
    rows = [row(params, output=o, prompt=p) for p, o in zip(prompts, outputs, strict=True)]
    got = _apply_penalties(logits, rows)
    for i in range(3):
        expected = reference_penalties(logits[i], prompts[i], outputs[i], repetition, presence, frequency)
        assert torch.allclose(got[i].double(), expected, atol=1e-5), f"row {i}"
    # Penalties never touch the caller's logits (logprobs are taken from them).
    assert torch.equal(logits, torch.randn(3, vocab, generator=torch.Generator().manual_seed(7)) * 3)


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 1.0, -2.0, -2.1]])
    presence = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert sample(logits, [row(presence)], [None], torch.Generator()).token_ids == [0]
    assert sample(logits, [row(presence, output=[0])], [None], torch.Generator()).token_ids == [1]
    # Repetition on a prompt token: 3.0 / 1.2 = 2.5 < 2.9.
    repetition = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert sample(logits, [row(repetition, prompt=[0])], [None], torch.Generator()).token_ids == [1]
    # Negative logits are multiplied: -2.0 * 1.2 = -2.4 < -2.1 (token 3 falls below token 4).
    only_negative = torch.tensor([[-9.0, -9.0, -9.0, -2.0, -2.1]])
    assert sample(only_negative, [row(repetition, prompt=[3])], [None], torch.Generator()).token_ids == [4]


def test_engine_penalties_follow_the_definition_on_real_logits(llama_dir, make_llm, hf_models) -> None:
    """Every greedy step with penalties is the argmax of HF's logits penalized by the reference definition."""
    llm = make_llm(llama_dir)
    penalties = dict(repetition_penalty=1.3, presence_penalty=0.6, frequency_penalty=0.4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **penalties)
    decided_by_penalty = 0
    # Prompts (found by trying seeds) on which the tiny model wants to repeat itself or its prompt.
    for seed in (6, 7):
        prompt = random_prompt(20, seed=seed) * 2
        tokens = llm.generate([prompt], params)[0].outputs[0].token_ids
        with torch.no_grad():
            logits = hf_models(llama_dir)(torch.tensor([prompt + tokens])).logits[0].double()
        for step, token in enumerate(tokens):
            raw = logits[len(prompt) + step - 1]
            penalized = reference_penalties(raw, prompt, tokens[:step], 1.3, 0.6, 0.4)
            best2 = penalized.topk(2).values
            if (best2[0] - best2[1]).item() <= NEAR_TIE:
                break  # a near tie: the two implementations may legitimately part here
            assert token == int(penalized.argmax()), f"seed {seed} step {step}"
            decided_by_penalty += int(raw.argmax()) != token
    assert decided_by_penalty > 0, "the penalties never changed a choice; the test would be vacuous"


# -- greedy equivalents ------------------------------------------------------------------------------------


@pytest.mark.parametrize("knobs", [dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-6)], ids=str)
def test_degenerate_random_sampling_equals_greedy(knobs, llama_dir, make_llm) -> None:
    llm = make_llm(llama_dir)
    prompts = [random_prompt(n, seed=n) for n in (4, 50)]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    sampled = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, **knobs))
    assert [r.outputs[0].token_ids for r in sampled] == [r.outputs[0].token_ids for r in greedy]


# -- stops and finish reasons ------------------------------------------------------------------------------


def greedy_run(llm, prompt: list[int], max_tokens: int = 20, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)
    return llm.generate([prompt], params)[0].outputs[0]


def first_new_token(tokens: list[int], start: int) -> tuple[int, int]:
    """(index, token) of the first token at or after `start` that does not occur earlier in `tokens`."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i, tokens[i]
    raise AssertionError("no fresh token in the greedy continuation")


def test_max_tokens_finishes_with_length(llama_dir, make_llm) -> None:
    llm = make_llm(llama_dir)
    seq = greedy_run(llm, random_prompt(10, seed=1), max_tokens=7)
    assert len(seq.token_ids) == 7 and seq.finish_reason == "length" and seq.stop_reason is None


def test_stop_token_ids_finish_with_stop(llama_dir, make_llm) -> None:
    llm = make_llm(llama_dir)
    prompt = random_prompt(10, seed=1)
    free = greedy_run(llm, prompt)
    index, token = first_new_token(free.token_ids, 4)
    seq = greedy_run(llm, prompt, stop_token_ids=[token, 4097])
    assert seq.token_ids == free.token_ids[:index + 1]
    assert seq.finish_reason == "stop" and seq.stop_reason == token


def test_min_tokens_blocks_stop_token_ids_before_the_minimum(llama_dir, make_llm) -> None:
    llm = make_llm(llama_dir)
    prompt = random_prompt(10, seed=1)
    free = greedy_run(llm, prompt, logprobs=2)
    index, token = first_new_token(free.token_ids, 4)
    min_tokens = index + 3
    seq = greedy_run(llm, prompt, stop_token_ids=[token], min_tokens=min_tokens, logprobs=2)
    assert token not in seq.token_ids[:min_tokens]
    assert seq.token_ids[:index] == free.token_ids[:index]
    # At `index` the stop token was the greedy choice; banned, the runner-up is taken instead.
    assert free.logprobs[index].top_ids[0] == token
    assert seq.token_ids[index] == free.logprobs[index].top_ids[1]
    # Logprobs still describe the model's distribution: the banned token keeps its place.
    assert seq.logprobs[index].top_ids[0] == token and seq.logprobs[index].rank == 2
    if seq.finish_reason == "stop":
        assert seq.token_ids[-1] == token and len(seq.token_ids) > min_tokens
    else:
        assert len(seq.token_ids) == 20


def with_extra_eos(token: int):
    def edit(path: Path) -> None:
        config_path = path / "generation_config.json"
        config = json.loads(config_path.read_text())
        config["eos_token_id"] = [config["eos_token_id"], token]
        config_path.write_text(json.dumps(config))
    return edit


def test_eos_stops_unless_min_tokens_or_ignore_eos(llama_dir, models, make_llm) -> None:
    prompt = random_prompt(10, seed=2)
    free = greedy_run(make_llm(llama_dir), prompt)
    index, token = first_new_token(free.token_ids, 3)
    # The same weights with `token` declared an end-of-sequence id in generation_config.json.
    eos_dir = models.variant(llama_dir, f"eos-{token}", with_extra_eos(token))
    llm = make_llm(eos_dir)
    assert token in llm.engine.eos_token_ids

    stopped = greedy_run(llm, prompt)
    assert stopped.token_ids == free.token_ids[:index + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None

    delayed = greedy_run(llm, prompt, min_tokens=index + 4)
    assert delayed.token_ids[:index] == free.token_ids[:index]
    assert token not in delayed.token_ids[:index + 4]

    ignored = greedy_run(llm, prompt, ignore_eos=True)
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_sampler_masks_eos_and_stop_ids_until_min_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]])  # token 2 (eos) best, then 3 (a stop id), then 4
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])

    def pick(output: list[int], p: SamplingParams = params) -> int:
        return sample(logits, [row(p, output=output, eos=(2,))], [None], torch.Generator()).token_ids[0]

    assert pick([]) == 4 and pick([1]) == 4
    assert pick([1, 1]) == 2  # the minimum is reached: eos is allowed again
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert pick([], ignore) == 2  # ignore_eos: eos is an ordinary token, min_tokens does not ban it


def stop_string_case(llm, prompt: list[int], free) -> tuple[str, int, int]:
    """A 4-character ASCII stop string spanning the boundary between output tokens k and k+1.

    Returns (stop, k + 1, start) with `start` the stop string's first occurrence in the free text."""
    tokens = free.token_ids
    for k in range(3, len(tokens) - 2):
        boundary = len(llm.tokenizer.decode(tokens[:k + 1]))
        stop = free.text[boundary - 2:boundary + 2]
        completes_at_k1 = len(llm.tokenizer.decode(tokens[:k + 2])) >= boundary + 2
        if len(stop) == 4 and stop.isascii() and stop.isprintable() and free.text.find(stop) == boundary - 2 \
                and completes_at_k1:
            if llm.tokenizer.decode(tokens[:k + 1]) == free.text[:boundary]:
                return stop, k + 1, boundary - 2
    raise AssertionError("no usable stop string in the greedy text")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_the_text(include, llama_dir, make_llm) -> None:
    llm = make_llm(llama_dir)
    prompt = random_prompt(12, seed=3)
    free = greedy_run(llm, prompt, max_tokens=24)
    stop, last, start = stop_string_case(llm, prompt, free)
    seq = greedy_run(llm, prompt, max_tokens=24, stop=["never-in-this-text", stop],
                     include_stop_str_in_output=include)
    # Generation ends with the token that completes the stop string.
    assert seq.token_ids == free.token_ids[:last + 1]
    assert seq.text == free.text[:start + len(stop)] if include else seq.text == free.text[:start]
    assert seq.finish_reason == "stop" and seq.stop_reason == stop


def test_stop_string_completed_by_the_last_allowed_token(llama_dir, make_llm) -> None:
    """max_tokens and a stop string on the same token: the stop string still cuts the text (as in vLLM)."""
    llm = make_llm(llama_dir)
    prompt = random_prompt(12, seed=3)
    free = greedy_run(llm, prompt, max_tokens=24)
    stop, last, start = stop_string_case(llm, prompt, free)
    seq = greedy_run(llm, prompt, max_tokens=last + 1, stop=[stop])
    assert seq.token_ids == free.token_ids[:last + 1]
    assert seq.text == free.text[:start]
    assert seq.finish_reason == "stop" and seq.stop_reason == stop


def test_min_tokens_holds_back_stop_strings(llama_dir, make_llm) -> None:
    llm = make_llm(llama_dir)
    prompt = random_prompt(12, seed=3)
    free = greedy_run(llm, prompt, max_tokens=24)
    stop, last, start = stop_string_case(llm, prompt, free)
    # With the stop string's last token inside the minimum, that occurrence does not count.
    seq = greedy_run(llm, prompt, max_tokens=24, stop=[stop], min_tokens=last + 1)
    assert seq.token_ids[:last + 1] == free.token_ids[:last + 1]
    assert len(seq.token_ids) > last + 1
    assert seq.text.startswith(free.text[:start + len(stop)])
    # One token less and it counts again.
    seq = greedy_run(llm, prompt, max_tokens=24, stop=[stop], min_tokens=last)
    assert seq.text == free.text[:start] and seq.finish_reason == "stop"


# -- logprobs ----------------------------------------------------------------------------------------------


def test_sampler_logprobs_equal_direct_log_softmax_of_raw_logits() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=generator) * 2
    # Temperature and penalties shape the choice but not the reported logprobs (vLLM's raw logprobs).
    params = [SamplingParams(temperature=1.0, logprobs=5), SamplingParams(temperature=0.5, logprobs=3),
              SamplingParams(temperature=2.0, logprobs=0), SamplingParams(temperature=0.0, logprobs=20),
              SamplingParams(temperature=1.5, logprobs=5, presence_penalty=1.0, repetition_penalty=1.5),
              SamplingParams(temperature=1.0)]
    rows = [row(p, output=[1, 2, 3], prompt=[4, 5]) for p in params]
    ranks = []
    for seed in range(10):
        result = sample(logits, rows, [None] * len(rows), torch.Generator().manual_seed(seed))
        assert set(result.logprobs) == {0, 1, 2, 3, 4}
        for i, lp in result.logprobs.items():
            ref = torch.log_softmax(logits[i].double(), dim=-1)
            token = result.token_ids[i]
            assert lp.token_id == token
            assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-5)
            assert lp.rank == 1 + int((ref > ref[token]).sum())
            num = params[i].logprobs
            top = ref.topk(num) if num else None
            assert lp.top_ids == (top.indices.tolist() if num else [])
            assert lp.top_logprobs == pytest.approx(top.values.tolist() if num else [], abs=1e-5)
            ranks.append(lp.rank)
    assert max(ranks) > 1  # sampled tokens other than the argmax were checked too


def test_engine_logprobs_of_sampled_tokens_match_transformers(llama_dir, make_llm, hf_models) -> None:
    prompt = random_prompt(30, seed=9)
    params = SamplingParams(temperature=1.2, seed=5, max_tokens=20, ignore_eos=True, logprobs=5)
    seq = make_llm(llama_dir, max_num_batched_tokens=16).generate([prompt], params)[0].outputs[0]
    with torch.no_grad():
        logits = hf_models(llama_dir)(torch.tensor([prompt + seq.token_ids])).logits[0].double()
    ranks = []
    for step, (token, lp) in enumerate(zip(seq.token_ids, seq.logprobs, strict=True)):
        ref = torch.log_softmax(logits[len(prompt) + step - 1], dim=-1)
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-3)
        # Rank from the reference, unless the chosen token is within the tolerance of another one.
        if ((ref - ref[token]).abs() < 1e-3).sum() == 1:
            assert lp.rank == 1 + int((ref > ref[token]).sum()), f"step {step}"
        assert lp.top_logprobs == pytest.approx(ref.topk(5).values.tolist(), abs=1e-3)
        assert [ref[t].item() for t in lp.top_ids] == pytest.approx(lp.top_logprobs, abs=1e-3)
        ranks.append(lp.rank)
    assert max(ranks) > 1
    assert math.isfinite(sum(lp.logprob for lp in seq.logprobs))
