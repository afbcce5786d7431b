"""The usage a client gets for a request P prefilled and D decoded (pdserve/gateway/usage.py): prompt and cached
tokens from P, completion tokens from D; and D's answer exactly as D wrote it when P's counts change nothing.
Checked with the standard library's JSON reader, not the gateway's."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pdserve.gateway.usage import adds_nothing, merge_answer, merged_usage

# Spaces and a line break where msgspec writes none: any answer the gateway wrote again would differ in bytes.
D_ANSWER = (b'{"id": "cmpl-1", "object": "text_completion",\n "choices": [{"index": 0, "text": " a b c"}],\n'
            b' "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,'
            b' "prompt_tokens_details": {"cached_tokens": 3}}}')


def test_p_counts_the_prompt_and_its_cache_hits_and_d_the_completion() -> None:
    raw = merge_answer({"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10,
                  "prompt_tokens_details": {"cached_tokens": 5}}, D_ANSWER)
    out = json.loads(raw)
    assert out["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12,
                            "prompt_tokens_details": {"cached_tokens": 5}}
    assert {k: v for k, v in out.items() if k != "usage"} == {
        k: v for k, v in json.loads(D_ANSWER).items() if k != "usage"}
    assert b'[{"index": 0, "text": " a b c"}]' in raw  # the other fields as D wrote them, not written again


def test_when_p_changes_nothing_d_answer_goes_out_as_d_wrote_it() -> None:
    agreeing = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8,
                "prompt_tokens_details": {"cached_tokens": 3}}
    assert merge_answer(agreeing, D_ANSWER) == D_ANSWER
    # vLLM sends null details unless asked for them: nothing to add, so nothing is rewritten.
    assert merge_answer({**agreeing, "prompt_tokens_details": None}, D_ANSWER) == D_ANSWER
    assert merge_answer(None, D_ANSWER) == D_ANSWER  # D prefilled itself


def test_answers_without_a_usage_object_are_left_alone() -> None:
    for raw in (b"not json", b"[1, 2]", b'"text"', b'{"usage": null}', b'{"usage": 3}', b'{"choices": []}',
                b'{"usage": {"prompt_tokens": 7, "completion_tokens": null}}'):
        assert merge_answer({"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 5}}, raw) == raw


_counts = st.one_of(st.none(), st.integers(0, 3))
_details = st.one_of(st.none(), st.integers(0, 3), st.dictionaries(st.sampled_from(["cached_tokens", "x"]), _counts))
_usage = st.fixed_dictionaries({}, optional={"prompt_tokens": st.integers(0, 3), "completion_tokens": st.integers(0, 3),
                                             "total_tokens": st.integers(0, 6), "prompt_tokens_details": _details,
                                             "other": _counts})


@st.composite
def _pairs(draw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """P's and D's usage: unrelated, or D's already merged (what agreeing instances send) with one key changed or
    dropped, so that both answers of the check come up often."""
    prefill, decode = draw(_usage), draw(_usage)
    if draw(st.booleans()):
        try:
            decode = merged_usage(prefill, decode)
        except TypeError:  # D's details are no object: nothing to merge them with
            return prefill, decode
        if decode and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(decode)))
            if draw(st.booleans()):
                del decode[key]
            else:
                decode[key] = draw(st.one_of(_counts, _details))
    return prefill, decode


@settings(max_examples=500)
@given(_pairs())
def test_the_quick_check_says_what_building_the_merge_would(pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    prefill, decode = pair
    try:
        unchanged = merged_usage(prefill, decode) == decode
    except TypeError:  # a count that is no number (null): the gateway passes such an answer on as it is
        assume(False)
    assert adds_nothing(prefill, decode) == unchanged
