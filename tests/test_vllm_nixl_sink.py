"""A live vLLM-CPU decode instance (NixlConnector, kv_consumer) reads a prompt's KV from a pdserve prefill instance.

What must hold: driven as vLLM's toy proxy drives a pair, and through the pdserve gateway (pull), vLLM D answers
exactly as the same vLLM answers colocated (tokens equal, logprobs within the cross-process bound) for a prompt
inside one vLLM block and one spanning three, having really received the prompt's KV over NIXL (its
external-transfer prompt-token counter rises by the prompt's length); afterwards pdserve P holds no blocks, pool or
mirror, freed by vLLM's read notification rather than the lease. vLLM's side channel on P survives requests that
are not vLLM's handshake.

One vLLM instance for the module (it busy-polls a core), which is also the colocated oracle.
"""

from __future__ import annotations

import json

import msgspec
import pytest
import zmq

from conftest import random_prompt
from pdserve.kv_transfer.vllm_nixl.wire import AgentMetadata, HandshakePayload
from pdserve.launcher import start_instance, stop_all
from peers import reserved_port
from server_utils import (disaggregated_equals_colocated, gateway_pull_equals_colocated, metric_values, wait_for,
                          wait_until_idle)
from vllm_live import ready, start_vllm, vllm_pulled

pytestmark = pytest.mark.vllm

# 20 tokens sit in one vLLM block (128); 300 span three, the last partly.
PROMPTS = [random_prompt(20, 51), random_prompt(300, 52)]
LEASE_S = 60  # far longer than a test: a hold freed within it was freed by vLLM's notification


@pytest.fixture(scope="module")
def pair(models):
    model = models("llama")
    # Without prefix caching the colocated answers (the oracle) never lend D blocks, and D pulls every prompt token.
    vllm_d = start_vllm(model, role="kv_consumer", name="vD", wait=False, extra_args=("--no-enable-prefix-caching",))
    started = [vllm_d]
    try:
        side_channel = reserved_port()
        config = {"kv_connector": "PdConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {
            "vllm_nixl_port": side_channel, "vllm_model": str(model), "kv_lease_duration": LEASE_S}}
        started.append(start_instance(model, "--max-model-len", "512", "--num-kv-blocks", "128",
                                      "--served-model-name", "tiny", "--kv-transfer-config", json.dumps(config),
                                      name="pP"))
        ready(vllm_d)
        yield {"vD": vllm_d.url, "pP": started[1].url, "side_channel": side_channel}
    finally:
        stop_all(reversed(started))


def assert_p_freed_by_notification(p_url: str, before: dict[str, float]) -> None:
    """P holds nothing, pool blocks or mirror blocks, and no lease ran out: vLLM's read-done freed them."""
    def held() -> float:
        values = metric_values(p_url)
        return values["pdserve:kv_leases_held"] + values["pdserve:kv_vllm_mirror_blocks_held"]

    wait_for(lambda: held() == 0, timeout=20, what="pdserve P's hold for vLLM to end")
    after = wait_until_idle(p_url)
    assert after["pdserve:kv_lease_expired_requests_total"] == before["pdserve:kv_lease_expired_requests_total"]
    assert after["pdserve:kv_read_done_received_total"] - before["pdserve:kv_read_done_received_total"] == 1


@pytest.mark.parametrize("prompt", PROMPTS, ids=["one-vllm-block", "three-vllm-blocks"])
def test_vllm_decode_pulls_kv_from_pdserve_prefill(pair, prompt):
    vd, pp = pair["vD"], pair["pP"]
    before, pulled = metric_values(pp), vllm_pulled(vd)
    params = disaggregated_equals_colocated(vd, pp, vd, prompt)
    assert params["remote_port"] == pair["side_channel"] and "transfer_token" not in params
    assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == -(-len(prompt) // 128)
    assert vllm_pulled(vd) - pulled == len(prompt)
    assert_p_freed_by_notification(pp, before)


def test_gateway_pairs_pdserve_prefill_with_a_vllm_decode_that_reads_from_it(pair):
    """A pool of one pdserve P with vLLM's side channel and one vLLM NixlConnector D serves `pull` (before, it
    could not start: no pair); the answer equals colocated vLLM, and vLLM D received the KV."""
    vd, pp = pair["vD"], pair["pP"]
    prompt = random_prompt(150, 53)
    before, pulled = metric_values(pp), vllm_pulled(vd)
    gateway_pull_equals_colocated(vd, pp, vd, prompt)
    assert vllm_pulled(vd) - pulled == len(prompt)
    assert_p_freed_by_notification(pp, before)


def test_side_channel_refuses_anything_but_vllms_handshake(pair):
    """Garbage, another rank, a pdserve-looking message: each gets a refusal, and the handshake still works."""
    refusals = "pdserve:kv_vllm_side_channel_refusals_total"
    before = metric_values(pair["pP"])[refusals]
    ctx = zmq.Context()
    try:
        for request in (b"\xff\x00garbage", msgspec.msgpack.encode((b"get_meta_msg", 0, 1)),
                        msgspec.msgpack.encode({"type": "handshake"})):
            with ctx.socket(zmq.REQ) as sock:
                sock.setsockopt(zmq.RCVTIMEO, 10_000)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(f"tcp://127.0.0.1:{pair['side_channel']}")
                sock.send(request)
                assert len(sock.recv_multipart()) == 1  # a refusal, not a handshake answer
        with ctx.socket(zmq.REQ) as sock:
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{pair['side_channel']}")
            sock.send(msgspec.msgpack.encode((b"get_meta_msg", 0, 0)))
            payload, clock = sock.recv_multipart()
        meta = msgspec.msgpack.decode(msgspec.msgpack.decode(payload, type=HandshakePayload).agent_metadata_bytes,
                                      type=AgentMetadata)
        assert meta.attn_backend_name == "CPU_ATTN" and meta.block_size == 128 and len(meta.block_lens) == 2
        assert isinstance(msgspec.msgpack.decode(clock), float)
        assert metric_values(pair["pP"])[refusals] - before == 3
    finally:
        ctx.term()
    test_vllm_decode_pulls_kv_from_pdserve_prefill(pair, random_prompt(40, 54))
