"""Oversized input never blocks an instance or a gateway.

A body over the limit gets 413 before it is read (a declared Content-Length) or as soon as the count passes the
limit (a chunked upload); a prompt too long for the context gets 400 without being tokenized, and tokenizing never
runs on the event loop, so /health and small requests are answered meanwhile.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from pdserve.launcher import start, start_instance, stop_all
from pdserve.net.body import DEFAULT_MAX_BODY_BYTES
from server_utils import wait_until_idle

MAX_MODEL_LEN = 256
TINY = {"model": "tiny", "prompt": "a small request", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def stack(models):
    procs = {}
    try:
        procs["instance"] = start_instance(models("qwen2"), "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks",
                                           "64", "--served-model-name", "tiny", name="limits")
        procs["gateway"] = start("gateway", ["gateway", "--both", procs["instance"].url, "--protocol", "colocated",
                                             "--port", "0", "--log-level", "warning"])
        yield procs
    finally:
        stop_all(procs.values())


def declared_only(url: str, length: int, timeout: float = 30.0) -> tuple[int, dict]:
    """POST headers declaring `length` body bytes, and send none: the answer must come without the body."""
    where = urlparse(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(length))
        conn.endheaders()
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def assert_413(status: int, body: dict) -> None:
    assert status == 413
    assert body["error"]["code"] == 413 and str(DEFAULT_MAX_BODY_BYTES) in body["error"]["message"]


@pytest.mark.parametrize("who", ["instance", "gateway"])
def test_declared_oversized_body_is_refused_before_it_is_read(stack, who):
    status, body = declared_only(stack[who].url, 10 << 30)  # 10 GiB declared, nothing sent
    assert_413(status, body)


@pytest.mark.parametrize("who", ["instance", "gateway"])
def test_chunked_oversized_body_is_refused_while_it_streams(stack, who):
    piece = b"x" * (1 << 20)

    def chunks():  # no Content-Length: httpx sends it chunked
        for _ in range((DEFAULT_MAX_BODY_BYTES >> 20) + 8):
            yield piece

    r = httpx.post(stack[who].url + "/v1/completions", content=chunks(), timeout=120,
                   headers={"content-type": "application/json"})
    assert_413(r.status_code, r.json())
    assert httpx.post(stack[who].url + "/v1/completions", json=TINY, timeout=120).status_code == 200


@pytest.mark.parametrize("form", ["text", "chat", "token_ids"])
def test_huge_prompt_is_refused_unread_while_others_are_served(stack, form):
    url = stack["instance"].url
    text = "lorem ipsum dolor sit amet " * 370_000  # 10 MB: under the body limit, far over the context
    path = "/v1/chat/completions" if form == "chat" else "/v1/completions"
    body = {"model": "tiny", "max_tokens": 4, **{
        "text": {"prompt": text}, "chat": {"messages": [{"role": "user", "content": text}]},
        "token_ids": {"prompt": [1234] * 1_800_000}}[form]}  # 9 MB of JSON
    answers: dict[str, tuple[httpx.Response, float]] = {}

    def timed(name: str, method: str, target: str, **kwargs) -> None:
        t0 = time.monotonic()
        answers[name] = (httpx.request(method, url + target, timeout=300, **kwargs), time.monotonic() - t0)

    big = threading.Thread(target=timed, args=("big", "POST", path), kwargs={"json": body})
    big.start()
    time.sleep(0.5)  # the upload is on its way (or done): the instance is parsing or tokenizing it now
    timed("health", "GET", "/health")
    timed("tiny", "POST", "/v1/completions", json=TINY)
    big.join(300)
    response, _ = answers["big"]
    assert response.status_code == 400, response.text
    assert "maximum context length" in response.json()["error"]["message"]
    assert answers["tiny"][0].status_code == 200
    # Tokenizing 10 MB takes ~10 s of CPU here: on the event loop, /health would wait for all of it.
    latencies = {name: round(seconds, 2) for name, (_, seconds) in answers.items()}
    assert latencies["health"] < 5 and latencies["big"] < 30, latencies
    wait_until_idle(url)


def test_prompt_within_the_character_bound_is_checked_exactly_in_tokens(stack, models):
    from transformers import AutoTokenizer

    text = "hello there " * 200  # well under the character bound, over 256 tokens
    tokens = len(AutoTokenizer.from_pretrained(models("qwen2"))(text).input_ids)
    r = httpx.post(stack["instance"].url + "/v1/completions", json={**TINY, "prompt": text}, timeout=120)
    assert r.status_code == 400
    assert (f"maximum context length is {MAX_MODEL_LEN} tokens. However, your request has {tokens} input tokens"
            in r.json()["error"]["message"])
