"""vLLM's side of a pdserve prefill instance without vLLM: its mirror read by pdserve's own vLLM NIXL loader.

A pdserve D configured to load from vLLM NixlConnector producers speaks vLLM 0.32's handshake, checks its
compatibility hash and reads vLLM-CPU's layout, so it can stand in for a vLLM decoder (the live pair is in
test_vllm_nixl_sink.py): driven as vLLM's toy proxy drives a pair, its answer equals P's colocated answer, the
KV was loaded, and P's mirror and pool hold nothing afterwards, freed by the read's notification. Unread, the
mirror blocks go back when the lease runs out. Needs NIXL (skipped without it, failing under CI=true).
"""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import random_prompt
from pdserve.kv_transfer.pull_producer import PullProducer
from pdserve.kv_transfer.runtime import AgentConfig, AgentRuntime
from pdserve.kv_transfer.vllm_nixl.producer import MirrorConfig, VllmNixlProducer
from pdserve.kv_transfer.vllm_nixl.wire import ModelShape
from pdserve.launcher import LaunchError, start, start_instance
from server_utils import (completion_body, data_planes, disaggregated_equals_colocated, metric_values, processes,
                          wait_for, wait_until_idle)

pytestmark = pytest.mark.parametrize("plane", data_planes("nixl"))
LEASE_S = 4


@pytest.fixture(scope="module")
def pair(models):
    model = models("llama")
    producer = {"kv_connector": "PdConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {
        "vllm_nixl_port": 0, "vllm_block_size": 32, "vllm_mirror_blocks": 12, "kv_lease_duration": LEASE_S}}
    consumer = {"kv_connector": "PdConnector", "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"vllm_nixl": True}}
    common = ("--max-model-len", "512", "--num-kv-blocks", "128", "--served-model-name", "tiny")
    plain = {"kv_connector": "PdConnector", "kv_role": "kv_producer"}
    with processes(
            P=lambda: start_instance(model, *common, "--kv-transfer-config", json.dumps(producer), name="P"),
            D=lambda: start_instance(model, *common, "--kv-transfer-config", json.dumps(consumer), name="D"),
            plainP=lambda: start_instance(model, *common, "--kv-transfer-config", json.dumps(plain), name="plainP"),
    ) as procs:
        yield {name: proc.url for name, proc in procs.items()}


def held(url: str) -> float:
    values = metric_values(url)
    return values["pdserve:kv_leases_held"] + values["pdserve:kv_vllm_mirror_blocks_held"]


@pytest.mark.parametrize("length", [20, 150], ids=["one-mirror-block", "five-mirror-blocks"])
def test_vllm_loader_reads_the_mirror(pair, plane, length):
    p, d = pair["P"], pair["D"]
    before_p, before_d = metric_values(p), metric_values(d)
    params = disaggregated_equals_colocated(p, p, d, random_prompt(length, 60 + length))
    assert len(params["remote_block_ids"][0]) == -(-length // 32) and "transfer_token" not in params
    after_d = wait_until_idle(d)
    assert after_d["pdserve:kv_transfer_loads_ok_total"] - before_d["pdserve:kv_transfer_loads_ok_total"] == 1
    wait_for(lambda: held(p) == 0, timeout=LEASE_S * 3, what="P's mirror hold to end")
    after_p = wait_until_idle(p)
    assert after_p["pdserve:kv_read_done_received_total"] - before_p["pdserve:kv_read_done_received_total"] == 1
    assert after_p["pdserve:kv_lease_expired_requests_total"] == before_p["pdserve:kv_lease_expired_requests_total"]


def test_unread_mirror_blocks_return_when_the_lease_ends(pair, plane):
    p = pair["P"]
    before = metric_values(p)
    answer = httpx.post(f"{p}/v1/completions", timeout=120, json=completion_body(random_prompt(70, 61), max_tokens=1,
                        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})).json()
    assert len(answer["kv_transfer_params"]["remote_block_ids"]) == 1  # one KV group, as vLLM 0.32 lists them
    assert metric_values(p)["pdserve:kv_vllm_mirror_blocks_held"] == 3  # 70 tokens in blocks of 32
    assert wait_until_idle(p)["pdserve:kv_blocks_in_use"] == 0  # the pool's blocks are not held: copied out
    wait_for(lambda: held(p) == 0, timeout=LEASE_S * 5, what="the lease to free the mirror blocks")
    after = metric_values(p)
    assert after["pdserve:kv_lease_expired_requests_total"] - before["pdserve:kv_lease_expired_requests_total"] == 1


def test_a_full_mirror_hands_off_nothing(pair, plane):
    """More vLLM blocks than the mirror has: P answers without transfer parameters (D computes the prompt)."""
    p = pair["P"]
    answer = httpx.post(f"{p}/v1/completions", timeout=120, json=completion_body(random_prompt(510, 62), max_tokens=1,
                        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})).json()
    assert not answer.get("kv_transfer_params")
    assert held(p) == 0
    wait_until_idle(p)


def gateway(*args: str):
    return start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--protocol", "pull", *args])


def test_gateway_asks_for_vllms_shape_when_the_decoder_is_vllm(pair, plane, recorded):
    """With a vLLM NixlConnector D (a fake that records what it is sent), the gateway pairs it only with a pdserve P
    that lists vLLM among its KV sinks, asks that P for vLLM's shape, and hands D exactly vLLM's fields."""
    start_fake, received = recorded
    vllm_d = start_fake("vD", "--kind", "vllm").url
    with pytest.raises(LaunchError) as refused:
        gateway("--prefill", pair["plainP"], "--decode", vllm_d)
    assert "can serve the pull protocol" in str(refused.value)
    g = gateway("--prefill", pair["P"], "--decode", vllm_d)
    try:
        r = httpx.post(f"{g.url}/v1/completions", json=completion_body(random_prompt(40, 63)), timeout=60)
        assert r.status_code == 200, r.text
    finally:
        g.stop()
    params = received("vD")[-1]["body"]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and len(params["remote_block_ids"][0]) == 2
    assert not {"transfer_token", "transfer_id", "remote_prompt_hash", "hand_off"} & set(params)
    wait_for(lambda: held(pair["P"]) == 0, timeout=LEASE_S * 5, what="the lease to free the unread mirror blocks")


def test_staged_pick_of_a_vllm_decoder_after_a_pdserve_shaped_answer_recomputes(pair, plane, recorded):
    """Staged scheduling picks D after P answered, in pdserve's shape (no D was known to ask for vLLM's): a vLLM D
    is sent the plain request, never parameters it cannot read, and P's KV is released at once, not left to the
    lease."""
    start_fake, received = recorded
    vllm_d = start_fake("vD", "--kind", "vllm").url
    before = metric_values(pair["P"])
    g = gateway("--prefill", pair["P"], "--decode", vllm_d, "--scheduling", "staged")
    try:
        r = httpx.post(f"{g.url}/v1/completions", json=completion_body(random_prompt(40, 64)), timeout=60)
        assert r.status_code == 200, r.text
        assert 'reason="kv_params_not_vllm_shaped"} 1.0' in httpx.get(f"{g.url}/metrics").text
    finally:
        g.stop()
    assert "kv_transfer_params" not in received("vD")[-1]["body"]
    wait_for(lambda: held(pair["P"]) == 0, timeout=LEASE_S / 2, what="the gateway's release to free P's KV")
    after = metric_values(pair["P"])
    assert after["pdserve:kv_releases_received_total"] - before["pdserve:kv_releases_received_total"] == 1


def test_vllm_notifications_end_only_vllm_holds(plane):
    """vLLM's read-done carries no token: it ends a hold made for a vLLM decoder, never a pdserve transfer's hold
    (whose capability it does not hold); heartbeats and malformed notifications end nothing."""
    rt = AgentRuntime(AgentConfig("P", "hash"))
    leases = PullProducer(rt)
    producer = VllmNixlProducer("P", ModelShape("m", "torch.float32", 2, 32, 2),
                                MirrorConfig("127.0.0.1", 0, 32, 4, "0.32.0"), leases)
    leases.hold("for-vllm", "", [0, 1], vllm=True)
    leases.hold("for-pdserve", "secret", [5])
    for text in ("for-pdserve:1", "HB:for-vllm,for-pdserve,gone", "no-count", ":1", "for-vllm:x"):
        producer._on_notification(text)
    assert leases.take_released() == set() and leases.num_leases() == 2
    assert leases.authorize_read("for-vllm", "", [0]) is not None  # never granted on pdserve's planes
    producer._on_notification("for-vllm:1")
    assert leases.take_released() == {"for-vllm"} and leases.num_leases() == 1
