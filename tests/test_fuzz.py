"""Property-based fuzzing of both HTTP fronts: an instance's OpenAI API and the gateway's, over real sockets.

schemathesis generates requests from the instance's own /openapi.json (which names the models its request
bodies must satisfy): valid bodies with extreme values, and bodies that break the schema (wrong types,
missing and extra fields). The gateway serves the same OpenAI routes, so the same document drives it. Bytes
that are not JSON at all come from plain hypothesis strategies. Every answer must hold these properties:

* never a 5xx: whatever the client sends, it is the client's error (4xx) or an answer;
* every error is OpenAI's JSON shape, including an error event inside a stream;
* afterwards every process is alive and healthy, and holds nothing: no KV blocks, requests or leases.

Bounded for CI; PDSERVE_FUZZ_EXAMPLES=2000 (say) runs longer.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

from pdserve.launcher import start, start_instance, stop_all
from server_utils import wait_until_idle
from test_gateway import kv

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "100"))
COMMON = ["--max-model-len", "64", "--num-kv-blocks", "64", "--served-model-name", "tiny",
          "--max-num-batched-tokens", "64"]
# No explain phase: it replays a failure ~80 times against live servers to annotate it, for little insight.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, phases=set(Phase) - {Phase.explain},
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.function_scoped_fixture])
POSTS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def instance(models):
    proc = start_instance(models("qwen2"), *COMMON, name="fuzz-colocated")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def pull_pair(models):
    procs = []
    try:
        for name, role in (("fuzz-P", "kv_producer"), ("fuzz-D", "kv_consumer")):
            procs.append(start_instance(models("qwen2"), *COMMON, "--kv-transfer-config", kv(role),
                                        name=name))
        prefill, decode = procs
        # --conditional: the gateway then reads the prompt itself, which is front-door code too.
        procs.append(start("fuzz-gateway", ["gateway", "--port", "0", "--log-level", "warning", "--protocol",
                                            "pull", "--prefill", prefill.url, "--decode", decode.url,
                                            "--conditional"]))
        yield {"P": prefill, "D": decode, "gateway": procs[2]}
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def api(instance) -> schemathesis.schemas.BaseSchema:
    document = httpx.get(f"{instance.url}/openapi.json", timeout=10).json()
    for path in POSTS:  # without them schemathesis would send no bodies, and only ever get 400s
        assert "requestBody" in document["paths"][path]["post"], f"{path}: the document names no body"
    return schemathesis.openapi.from_dict(document)


@pytest.fixture(scope="module")
def fronts(instance, pull_pair) -> dict[str, str]:
    return {"instance": instance.url, "gateway": pull_pair["gateway"].url}


def assert_openai_answer(status: int, content_type: str, body: bytes, sent: object) -> None:
    """The properties every answer must have, whatever was sent."""
    event(f"status {status}")  # --hypothesis-show-statistics: how many requests got past validation
    assert status < 500, f"{status} for {sent!r}: {body[:500]!r}"
    if status >= 400:
        assert content_type.startswith("application/json"), f"{status} with {content_type} for {sent!r}"
        assert_error_shape(json.loads(body), sent)
    elif content_type.startswith("text/event-stream"):
        for line in body.decode().splitlines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    assert_error_shape(chunk, sent)
                    assert chunk["error"]["code"] < 500, f"stream ended with {chunk} for {sent!r}"


def assert_error_shape(data: object, sent: object) -> None:
    assert isinstance(data, dict) and isinstance(data.get("error"), dict), f"not an OpenAI error: {data!r}"
    error = data["error"]
    assert isinstance(error.get("message"), str) and error["message"], f"no message: {data!r} for {sent!r}"
    assert isinstance(error.get("type"), str) and {"param", "code"} <= error.keys(), f"bad error {data!r}"
    assert "object at 0x" not in error["message"], f"a Python repr reached the client: {error['message']}"


# The gateway serves the instance's OpenAI routes, so the instance's document drives both fronts.
ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
          ("GET", "/v1/timeline/{request_id}"), ("GET", "/health"), ("GET", "/metrics")]


@pytest.mark.parametrize("front", ["instance", "gateway"])
@pytest.mark.parametrize(("method", "path"), ROUTES)
@given(data=st.data())
@FUZZ
def test_schema_fuzz(method, path, front, api, fronts, data):
    """Valid requests with extreme values, and requests that break the schema (schemathesis decides which)."""
    operation = api[path][method]
    mode = data.draw(st.sampled_from(list(GenerationMode)), label="mode")
    case = data.draw(operation.as_strategy(mode), label="case")
    response = case.call(base_url=fronts[front], timeout=120)
    content_type = (response.headers.get("content-type") or [""])[0]  # schemathesis lists a header's values
    assert_openai_answer(response.status_code, content_type, response.content,
                         (case.method, case.formatted_path, case.body))


# -- bytes that are not (quite) JSON -------------------------------------------------------------------------
_SCALARS = st.sampled_from([b"NaN", b"-Infinity", b"1e999", b"-0", b"18446744073709551616", b"-9" * 40,
                            b'"\\ud800"', b'"\\u0000"', b"null", b"true", b"[]", b"{}", b'"x"'])
_FIELDS = st.sampled_from([b"prompt", b"messages", b"max_tokens", b"n", b"seed", b"temperature", b"stop",
                           b"stream", b"logprobs", b"kv_transfer_params", b"model", b"top_k"])


def _near_json() -> st.SearchStrategy[bytes]:
    """Bodies a careless or hostile client sends: truncated or non-standard JSON, raw bytes, odd encodings."""
    member = st.tuples(_FIELDS, _SCALARS).map(lambda kv_: b'"' + kv_[0] + b'":' + kv_[1])
    objects = st.lists(member, max_size=6).map(lambda ms: b"{" + b",".join(ms) + b"}")
    valid = st.just(b'{"prompt": "hi", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}')
    truncated = st.tuples(valid, st.integers(0, 80)).map(lambda t: t[0][:t[1]])
    nested = st.integers(1, 100_000).map(lambda depth: b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}")
    return st.one_of(objects, truncated, nested, st.binary(max_size=64),
                     st.text(max_size=32).map(lambda s: s.encode("utf-16")),
                     objects.map(lambda b: b.replace(b"{", b"{\xff\xfe", 1)))


DEEP = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


# What the fuzzing found once, kept as fixed examples (each answered 500, or dropped the connection, before).
@example(path="/v1/completions", raw=b'{"prompt": []}', front="instance")
@example(path="/v1/completions", raw=DEEP, front="instance")
@example(path="/v1/chat/completions", raw=DEEP, front="gateway")
@example(path="/v1/chat/completions", raw=b'{"messages": 1.0}', front="gateway")
@example(path="/v1/completions", raw=b'{"prompt": "x", "request_id": "\\u0100"}', front="instance")
@example(path="/v1/completions", raw=b'{"prompt": "x", "request_id": "\\u001f"}', front="instance")
@example(path="/v1/completions", raw=b'{"prompt": [' + b"0," * 15 + b'-9223372036854775809]}', front="gateway")
@given(path=st.sampled_from(POSTS), raw=_near_json(), front=st.sampled_from(["instance", "gateway"]))
@FUZZ
def test_raw_bodies(path, raw, front, fronts):
    response = httpx.post(fronts[front] + path, content=raw, headers={"content-type": "application/json"},
                          timeout=120)
    assert_openai_answer(response.status_code, response.headers.get("content-type", ""), response.content,
                         (front, path, raw[:200]))


# -- afterwards ---------------------------------------------------------------------------------------------
def healthy(url: str, timeout: float = 10.0) -> bool:
    """/health answers 200 within the deadline (the gateway's probes, once a second, may need one round)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/health", timeout=10).status_code == 200:
            return True
        time.sleep(0.2)
    return False


def test_nothing_held_and_everyone_healthy(instance, pull_pair):
    """Runs last in this module: every process survived the fuzzing, and nothing it did is still held."""
    for proc in (instance, pull_pair["P"], pull_pair["D"], pull_pair["gateway"]):
        assert proc.alive(), f"{proc.name} died: {proc.log_tail()}"
        assert healthy(proc.url), f"{proc.name} is not healthy: {proc.log_tail()}"
    for proc in (instance, pull_pair["P"], pull_pair["D"]):
        values = wait_until_idle(proc.url, timeout=30)
        assert values.get("pdserve:kv_leases_held", 0) == 0, proc.name
        # The fuzzing reached the engine, not only the validation in front of it.
        assert values["vllm:generation_tokens_total"] > 0, proc.name
