"""Helpers for tests that talk to real pdserve processes over HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import stop_all


def data_planes(*names: str) -> list:
    """Parameters for tests run once per data plane. Planes over a third-party engine (nixl, mooncake) are
    optional: where the engine is missing their runs are skipped with the reason, except under CI=true, where they
    run and fail (CI installs them; a silent skip would hide a loss)."""
    from pdserve.kv_transfer.data_plane import DATA_PLANES, OPTIONAL_PLANES

    def param(name: str):
        if name not in OPTIONAL_PLANES:
            return name
        missing = name not in DATA_PLANES and os.environ.get("CI") != "true"
        return pytest.param(name, marks=pytest.mark.skipif(
            missing, reason=f"the {name} data plane's engine is not installed ({OPTIONAL_PLANES[name][3]})"))

    return [param(name) for name in names]


@contextlib.contextmanager
def processes(**starters: Callable[[], object]) -> Iterator[dict]:
    """Start each named process in order (a launcher call), yield them by name, and stop every one started."""
    procs: dict = {}
    try:
        for name, starter in starters.items():
            procs[name] = starter()
        yield procs
    finally:
        stop_all(procs.values())


def metric_values(base_url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by sample name (labels dropped; summed across label sets)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def wait_for_gateway_to_know(gateway_url: str, count: int, timeout: float = 30.0) -> None:
    """Until the gateway has identified `count` instances and finds them all healthy: on a loaded box its first
    checks at startup can time out, and a request sent meanwhile goes to whichever instance it knows already."""
    def knows() -> bool:
        values = metric_values(gateway_url)
        return values.get("pdserve:gateway_instance_info") == count == values.get("pdserve:gateway_instance_healthy")
    wait_for(knows, timeout, f"the gateway to know its {count} instances")


def wait_until_idle(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    """Wait until the instance holds no KV blocks and runs nothing; fail with the last reading otherwise."""
    deadline = time.monotonic() + timeout
    last: dict[str, float] = {}
    while time.monotonic() < deadline:
        last = metric_values(base_url)
        if (last.get("pdserve:kv_blocks_in_use", -1) == 0 and last.get("vllm:num_requests_running", -1) == 0
                and last.get("vllm:num_requests_waiting", -1) == 0):
            return last
        time.sleep(0.05)
    raise AssertionError(f"instance at {base_url} not idle after {timeout} s: "
                         f"blocks={last.get('pdserve:kv_blocks_in_use')} running={last.get('vllm:num_requests_running')} "
                         f"waiting={last.get('vllm:num_requests_waiting')}")


def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll `predicate` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def sse_events(response: httpx.Response) -> Iterator[dict]:
    """Parse a streamed SSE body into JSON events, stopping at [DONE]."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)


def toy_proxy(client: httpx.Client, prefill_url: str, decode_url: str, path: str, body: dict,
              request_id: str | None = None) -> tuple[httpx.Response, dict]:
    """Drive one request through P then D exactly as vLLM's NIXL toy proxy does; returns (D's response, P's JSON)."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    prefill_body = {k: v for k, v in body.items()
                    if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
    prefill_body.update({"max_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}})
    if "max_completion_tokens" in body:
        prefill_body["max_completion_tokens"] = 1
    p = client.post(f"{prefill_url}{path}", json=prefill_body, headers=headers)
    assert p.status_code == 200, p.text
    p_json = p.json()
    decode_body = dict(body)
    if p_json.get("kv_transfer_params"):
        decode_body["kv_transfer_params"] = p_json["kv_transfer_params"]
    return client.post(f"{decode_url}{path}", json=decode_body, headers=headers), p_json


def completion_body(prompt: list[int], **extra) -> dict:
    """A greedy completion of the tiny served model with token ids and logprobs, to compare across engines."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_token_ids": True, **extra}


def assert_same_answer(got: dict, expected: dict) -> None:
    """Same tokens and text; logprobs within the cross-process bound."""
    mine, theirs = got["choices"][0], expected["choices"][0]
    assert mine["token_ids"] == theirs["token_ids"]
    assert mine["text"] == theirs["text"]
    for a, b in zip(mine["logprobs"]["token_logprobs"], theirs["logprobs"]["token_logprobs"], strict=True):
        assert abs(a - b) <= CROSS_PROCESS_LOGPROB_TOL, (mine["logprobs"], theirs["logprobs"])


def disaggregated_equals_colocated(oracle_url: str, prefill_url: str, decode_url: str, prompt: list[int]) -> dict:
    """One prompt through P then D as vLLM's toy proxy drives them, compared with the oracle's colocated answer;
    returns P's kv_transfer_params."""
    expected = httpx.post(f"{oracle_url}/v1/completions", json=completion_body(prompt), timeout=120).json()
    with httpx.Client(timeout=120) as client:
        response, p_json = toy_proxy(client, prefill_url, decode_url, "/v1/completions", completion_body(prompt))
    assert response.status_code == 200, response.text
    assert_same_answer(response.json(), expected)
    return p_json["kv_transfer_params"]


def gateway_pull_equals_colocated(oracle_url: str, prefill_url: str, decode_url: str, prompt: list[int]) -> None:
    """One prompt through a gateway pairing P and D for `pull`, compared with the oracle's colocated answer."""
    from pdserve.launcher import start

    expected = httpx.post(f"{oracle_url}/v1/completions", json=completion_body(prompt), timeout=120).json()
    g = start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--prefill", prefill_url, "--decode",
                          decode_url, "--protocol", "pull"])
    try:
        response = httpx.post(f"{g.url}/v1/completions", json=completion_body(prompt), timeout=120)
        assert response.status_code == 200, response.text
        assert_same_answer(response.json(), expected)
    finally:
        g.stop()


# Logprobs of the same request from two instance processes: two fresh processes of the same engine and model were
# seen to differ by up to 5e-4 on a 480-token prompt (about 1 start in 6, each process then repeating itself
# exactly; not the hash seed, not address randomisation), so a comparison across processes allows 1e-3, the
# oracle tests' bound. Tokens must still be equal; a wrong or missing KV block moves logprobs far more than this.
CROSS_PROCESS_LOGPROB_TOL = 1e-3


def assert_json_equal(got, expected, shared_only: bool = False, path: str = "") -> None:
    """Equal JSON, floats within 1e-4. With `shared_only`, a key only one side has must hold null there."""
    if isinstance(got, dict) and isinstance(expected, dict):
        for key in got.keys() & expected.keys():
            assert_json_equal(got[key], expected[key], shared_only, f"{path}.{key}")
        extra = {k: v for k, v in {**got, **expected}.items() if (k in got) != (k in expected)}
        if shared_only:
            extra = {k: v for k, v in extra.items() if v is not None}
        assert not extra, f"{path}: fields only one side sends: {extra}"
    elif isinstance(got, list) and isinstance(expected, list):
        assert len(got) == len(expected), f"{path}: {got} != {expected}"
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_json_equal(a, b, shared_only, f"{path}[{i}]")
    elif isinstance(got, float) or isinstance(expected, float):
        assert got == pytest.approx(expected, abs=1e-4), path
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"
