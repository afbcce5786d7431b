"""Bad input at the door: every malformed or out-of-range request is a 4xx with an OpenAI error body, on an
instance and on the gateway in front of it, and none of them hurts the engine (it keeps serving, holds no KV)."""

from __future__ import annotations

import httpx
import pytest

from pdserve.launcher import start, start_instance, stop_all
from server_utils import wait_until_idle

COMMON = ["--max-model-len", "256", "--num-kv-blocks", "64", "--served-model-name", "tiny"]
MSG = [{"role": "user", "content": "x"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def front(models):
    """A colocated instance and a gateway in front of it."""
    model = models("qwen2")
    procs = []
    try:
        procs.append(start_instance(model, *COMMON, name="C"))
        procs.append(start("gateway", ["gateway", "--both", procs[0].url, "--protocol", "colocated",
                                       "--host", "127.0.0.1", "--port", "0"]))
        yield {"instance": procs[0], "gateway": procs[1]}
    finally:
        stop_all(procs)


@pytest.fixture(params=["instance", "gateway"])
def door(request, front):
    yield front[request.param]
    wait_until_idle(front["instance"].url)
    with httpx.Client(timeout=10) as c:
        assert c.get(f"{front['instance'].url}/health").status_code == 200


BAD_COMPLETIONS = [
    # Numbers the engine cannot take: each of these used to fail inside an engine step.
    ({"seed": 2 ** 64}, "seed"),
    ({"seed": -(2 ** 63) - 1}, "seed"),
    ({"top_k": -2}, "top_k"),
    ({"repetition_penalty": 5}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"n": 2 ** 70}, "n"),
    ({"logprobs": -1}, "logprobs"),
    ({"min_p": 1.5}, "min_p"),
    ({"truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 100000}, "truncate_prompt_tokens"),
    ({"prompt": []}, "prompt"),
    ({"stop_token_ids": [2 ** 70]}, "stop_token_ids"),
    # Features pdserve does not implement: refused by name, never silently ignored.
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"cache_salt": "tenant-a"}, "cache_salt"),
    ({"priority": 1}, "priority"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"add_special_tokens": False}, "add_special_tokens"),
]


@pytest.mark.parametrize("extra,param", BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_out_of_range_and_unsupported_completion_fields(door, extra, param):
    body = {"prompt": "hello", "max_tokens": 2, **extra}
    r = httpx.post(f"{door.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


BAD_CHATS = [
    ({"tools": TOOLS}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
]


@pytest.mark.parametrize("extra,param", BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_unsupported_chat_fields_are_named(door, extra, param):
    r = httpx.post(f"{door.url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_tools_with_tool_choice_none_are_only_rendered(door):
    r = httpx.post(f"{door.url}/v1/chat/completions", timeout=30,
                   json={"messages": MSG, "max_tokens": 2, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200, r.text


RAW_BODIES = {
    "invalid_utf8": b'{"prompt": "\xff\xfe", "max_tokens": 2}',
    "deep_list": b"[" * 100_000 + b"]" * 100_000,
    "deep_prompt": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "deep_object": b'{"prompt": "x", "a": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001,
    "not_json": b"{nope",
    "list": b"[1, 2]",
    "string": b'"hello"',
    "empty": b"",
}


@pytest.mark.parametrize("name", list(RAW_BODIES))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unreadable_bodies_get_json_400(door, name, path):
    r = httpx.post(f"{door.url}{path}", content=RAW_BODIES[name], timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]


def test_truncate_prompt_tokens_keeps_the_last_tokens(front):
    r = httpx.post(f"{front['instance'].url}/v1/completions", timeout=30, json={
        "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 2, "truncate_prompt_tokens": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["prompt_token_ids"] == [9, 10]


def test_request_id_is_bounded_and_cleaned(door):
    # The HTTP parser already refuses most control bytes; a tab and a non-ASCII byte get through to us.
    r = httpx.post(f"{door.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30,
                   headers={"X-Request-Id": b"ab\tc\xe9d " + b"e" * 1000})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "abcd" + "e" * 252
    assert r.json()["id"] == "cmpl-abcd" + "e" * 252


def test_bad_input_logs_no_traceback(front):
    # Every bad request above was a client error: nothing in either log looks like a crash.
    for proc in front.values():
        log = proc.log_tail(10_000_000)
        assert "Traceback" not in log, log[-3000:]
        assert "Exception in ASGI application" not in log
