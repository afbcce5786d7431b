"""Pull-mode disaggregation with real processes: P then D (driven like vLLM's toy proxy) equals colocated."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.launcher import start_instance, stop_all
from server_utils import CROSS_PROCESS_LOGPROB_TOL, data_planes, metric_values, toy_proxy, wait_until_idle

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "256", "--max-num-batched-tokens", "32",
          "--served-model-name", "tiny"]


def kv_config(role: str, plane: str, **extra) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role,
                       "kv_connector_extra_config": {"data_plane": plane, **extra}})


@pytest.fixture(scope="module", params=data_planes("shm", "tcp", "nixl", "mooncake"))
def cluster(request, models):
    model = models("qwen3")
    plane = request.param
    procs = []
    try:
        procs.append(start_instance(model, *COMMON, "--kv-transfer-config", kv_config("kv_producer", plane), name="P"))
        procs.append(start_instance(model, *COMMON, "--kv-transfer-config", kv_config("kv_consumer", plane), name="D"))
        procs.append(start_instance(model, *COMMON, name="colocated"))
        yield {"P": procs[0], "D": procs[1], "C": procs[2], "plane": plane,
               "block_bytes": procs[0].ready["kv_block_bytes"]}
    finally:
        stop_all(procs)


@pytest.fixture()
def client(cluster):
    with httpx.Client(timeout=60) as c:
        yield c
    for name in ("P", "D", "C"):
        wait_until_idle(cluster[name].url)
        assert metric_values(cluster[name].url).get("pdserve:kv_leases_held", 0) == 0


def colocated(client, cluster, body, path="/v1/completions"):
    r = client.post(cluster["C"].url + path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def assert_same_answer(pd: dict, ref: dict) -> None:
    a, b = pd["choices"][0], ref["choices"][0]
    assert a["token_ids"] == b["token_ids"]
    if a.get("logprobs"):
        lp_a, lp_b = a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < CROSS_PROCESS_LOGPROB_TOL


PROMPT_LENGTHS = {"one token": 1, "less than a block": 7, "exact blocks": 32, "several chunks": 100}


@pytest.mark.core
@pytest.mark.parametrize("length", PROMPT_LENGTHS.values(), ids=PROMPT_LENGTHS.keys())
def test_pull_equals_colocated(client, cluster, length):
    body = {"model": "tiny", "prompt": list(range(11, 11 + length)), "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, "return_token_ids": True}
    before = metric_values(cluster["D"].url)
    d, p = toy_proxy(client, cluster["P"].url, cluster["D"].url, "/v1/completions", body)
    assert d.status_code == 200, d.text
    params = p["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_request_id"]
    assert len(params["remote_block_ids"][0]) == -(-length // 16)
    assert_same_answer(d.json(), colocated(client, cluster, body))
    # The answer came from the transferred KV, not from a checksum failure's local recompute.
    after = metric_values(cluster["D"].url)
    for counter in ("pdserve:kv_blocks_invalid_total", "pdserve:kv_transfer_loads_failed_total"):
        assert after[counter] == before[counter], counter


def test_chat_and_streaming_through_pd(client, cluster):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "explain the KV cache"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 3}
    d, _ = toy_proxy(client, cluster["P"].url, cluster["D"].url, "/v1/chat/completions", body)
    assert d.status_code == 200
    events = [json.loads(line[6:]) for line in d.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    ref = colocated(client, cluster, {**body, "stream": False, "stream_options": None}, "/v1/chat/completions")
    assert text == ref["choices"][0]["message"]["content"]
    assert events[-1]["usage"]["completion_tokens"] == 12


def test_prefix_cache_hits_on_p_and_on_d(client, cluster):
    shared = list(range(200, 264))  # four blocks
    first = {"model": "tiny", "prompt": shared + [1, 2, 3], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
             "return_token_ids": True}
    toy_proxy(client, cluster["P"].url, cluster["D"].url, "/v1/completions", first)
    # P now has the shared prefix cached; D has it too (it loaded those blocks and cached them).
    second = {**first, "prompt": shared + [7, 8, 9, 10, 11]}
    before = metric_values(cluster["D"].url)["pdserve:kv_transfer_bytes_received_total"]
    d, p = toy_proxy(client, cluster["P"].url, cluster["D"].url, "/v1/completions", second)
    after = metric_values(cluster["D"].url)["pdserve:kv_transfer_bytes_received_total"]
    assert d.status_code == 200, d.text
    assert p["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # hit on P
    # D already held the four shared blocks: exactly one (the partial last block) crossed the wire.
    assert after - before == cluster["block_bytes"]
    assert_same_answer(d.json(), colocated(client, cluster, second))


def test_internal_ids_differ_between_p_and_d(client, cluster):
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0}
    d, p = toy_proxy(client, cluster["P"].url, cluster["D"].url, "/v1/completions", body, request_id="same-id-42")
    p_id = p["kv_transfer_params"]["remote_request_id"]
    d_id = d.headers["x-pdserve-request-ids"]
    assert p_id.startswith("cmpl-same-id-42-0-") and d_id.startswith("cmpl-same-id-42-0-")
    assert p_id != d_id
    assert d.headers["x-request-id"] == "same-id-42"


@pytest.mark.core
def test_32_concurrent_disaggregated_requests(client, cluster):
    bodies = [{"model": "tiny", "prompt": list(range(i, i + 5 + (i * 7) % 60)), "max_tokens": 6, "temperature": 0,
               "ignore_eos": True, "return_token_ids": True} for i in range(32)]

    def one(body):
        with httpx.Client(timeout=120) as c:
            d, _ = toy_proxy(c, cluster["P"].url, cluster["D"].url, "/v1/completions", body)
            return d.json()

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(one, bodies))
    for body, answer in zip(bodies, answers):
        assert_same_answer(answer, colocated(client, cluster, body))


def test_malformed_params_get_400_not_a_hang(client, cluster):
    base = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    bad = [
        {"do_remote_prefill": True},  # nothing else
        {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "e", "remote_request_id": "r",
         "remote_host": "127.0.0.1", "remote_port": "not-a-port"},
        {"do_remote_prefill": True, "remote_block_ids": "zero", "remote_engine_id": "e", "remote_request_id": "r",
         "remote_host": "127.0.0.1", "remote_port": 1},
        {"do_remote_prefill": True, "do_remote_decode": True},
        "a string",
    ]
    for params in bad:
        r = client.post(cluster["D"].url + "/v1/completions", json={**base, "kv_transfer_params": params})
        assert r.status_code == 400, (params, r.text)
        assert r.json()["error"]["param"] == "kv_transfer_params" or r.json()["error"]["code"] == 400


def test_tcp_channel_moves_blocks_in_any_order(tmp_path):
    """Whatever order the ids come in (descending, scattered), each remote block lands in its paired local block."""
    import torch

    from pdserve.kv_transfer.data_plane.tcp import TcpDataPlane

    shape = (32, 2, 2, 2, 4, 8)
    owner, reader = TcpDataPlane(), TcpDataPlane()
    pool = owner.allocate(shape, torch.float32)
    pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(shape))
    local = reader.allocate(shape, torch.float32)
    owner.start(lambda op, key, token, ids: None)
    channel = reader.connect(owner.local_info())
    try:
        remote_ids, local_ids = [9, 8, 7, 20, 3], [30, 2, 11, 12, 0]
        channel.read_blocks("k", "t", remote_ids, local_ids)
        for r, b in zip(remote_ids, local_ids):
            assert torch.equal(local[b], pool[r])
        local.zero_()
        channel.write_blocks("k", "t", local_ids, remote_ids, layer=None)  # and back, into the owner's pool
        for r in remote_ids:
            assert torch.equal(pool[r], torch.zeros_like(pool[r]))
    finally:
        channel.close()
        owner.stop()
