"""The usage a client gets for a request P prefilled and D decoded (pdserve/gateway/call.py): prompt and cached
tokens from P, completion tokens from D; and D's answer exactly as D wrote it when P's counts change nothing.
Checked with the standard library's JSON reader, not the gateway's."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from pdserve.gateway.call import Call

# Spaces and a line break where msgspec writes none: any answer the gateway wrote again would differ in bytes.
D_ANSWER = (b'{"id": "cmpl-1", "object": "text_completion",\n "choices": [{"index": 0, "text": " a b c"}],\n'
            b' "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,'
            b' "prompt_tokens_details": {"cached_tokens": 3}}}')


def merged(prefill_usage: dict[str, Any] | None, raw: bytes) -> bytes:
    return Call.merge_usage(SimpleNamespace(prefill_usage=prefill_usage), raw)


def test_p_counts_the_prompt_and_its_cache_hits_and_d_the_completion() -> None:
    out = json.loads(merged({"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 5}}, D_ANSWER))
    assert out["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12,
                            "prompt_tokens_details": {"cached_tokens": 5}}
    assert {k: v for k, v in out.items() if k != "usage"} == {
        k: v for k, v in json.loads(D_ANSWER).items() if k != "usage"}


def test_when_p_changes_nothing_d_answer_goes_out_as_d_wrote_it() -> None:
    agreeing = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8,
                "prompt_tokens_details": {"cached_tokens": 3}}
    assert merged(agreeing, D_ANSWER) == D_ANSWER
    # vLLM sends null details unless asked for them: nothing to add, so nothing is rewritten.
    assert merged({**agreeing, "prompt_tokens_details": None}, D_ANSWER) == D_ANSWER
    assert merged(None, D_ANSWER) == D_ANSWER  # D prefilled itself


def test_answers_without_a_usage_object_are_left_alone() -> None:
    for raw in (b"not json", b"[1, 2]", b'"text"', b'{"usage": null}', b'{"usage": 3}', b'{"choices": []}'):
        assert merged({"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 5}}, raw) == raw
