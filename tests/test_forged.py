"""Forged and malformed kv_transfer_params: nobody reads KV they were not granted; every case is a clear error
and leaves nothing held. The attacker is a client talking to D directly, or a rogue instance talking to P."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import zmq.asyncio

from pdserve.ids import new_transfer_id
from pdserve.kv_transfer.data_plane import DataPlaneError, make_data_plane
from pdserve.kv_transfer.messages import Ack, Heartbeat, ReadGrant, ReadGrantReply, Release
from pdserve.kv_transfer.side_channel import SideChannelClient
from pdserve.launcher import start_instance, stop_all
from server_utils import data_planes, metric_values, wait_until_idle

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "192", "--served-model-name", "tiny"]


def kv(role: str, plane: str, **extra) -> str:
    # The lease (also how long P waits for a push it never had before denying it) outlasts a forging test on a
    # loaded box (3 s once expired a held transfer before its owner's read) and stays below D's registration wait.
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role, "kv_connector_extra_config": {
        "data_plane": plane, "kv_lease_duration": 8.0, "push_registration_timeout": 20.0, **extra}})


@pytest.fixture(scope="module", params=data_planes("tcp", "nixl", "mooncake"))
def pd(models, request):
    model = models("llama")
    plane = request.param
    procs = {}
    try:
        procs["P"] = start_instance(model, *COMMON, "--kv-transfer-config", kv("kv_producer", plane), name="P")
        procs["D"] = start_instance(model, *COMMON, "--kv-transfer-config", kv("kv_consumer", plane), name="D")
        procs["C"] = start_instance(model, *COMMON, name="C")
        yield {**procs, "plane": plane}
    finally:
        stop_all(procs.values())


def prefill(pd, prompt: list[int]) -> dict:
    r = httpx.post(pd["P"].url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                          "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200
    return r.json()["kv_transfer_params"]


def decode(pd, prompt: list[int], params) -> httpx.Response:
    return httpx.post(pd["D"].url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                             "return_token_ids": True, "kv_transfer_params": params},
                      timeout=60)


A, B = list(range(10, 60)), list(range(300, 350))


@pytest.fixture()
def held(pd):
    """Two transfers P holds; the test forges with them, then both are read legitimately and everything ends."""
    a, b = prefill(pd, A), prefill(pd, B)
    yield a, b
    # B belongs to someone else: no forgery may have read or freed it, so its owner's read must still succeed.
    failed_before = metric_values(pd["D"].url)["pdserve:kv_transfer_loads_failed_total"]
    for prompt, params in ((B, b), (A, a)):
        r = decode(pd, prompt, params)
        ref = httpx.post(pd["C"].url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                                "return_token_ids": True}).json()
        assert r.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
        if prompt is B:
            assert metric_values(pd["D"].url)["pdserve:kv_transfer_loads_failed_total"] == failed_before
    for name in ("P", "D"):
        idle = wait_until_idle(pd[name].url, timeout=10)
        assert idle["pdserve:kv_leases_held"] == 0


def refused(r: httpx.Response, *words: str) -> None:
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


FORGERIES = {
    "another request's block ids": lambda a, b: {**a, "remote_block_ids": b["remote_block_ids"]},
    "out-of-range block ids": lambda a, b: {**a, "remote_block_ids": [[10 ** 6, 10 ** 6 + 1, 10 ** 6 + 2, 7]]},
    "wrong token": lambda a, b: {**a, "transfer_token": "0" * 32},
    "another request's key": lambda a, b: {**a, "remote_request_id": b["remote_request_id"]},
    "unknown key": lambda a, b: {**a, "remote_request_id": "cmpl-nobody-0-deadbeef"},
    "wrong engine id": lambda a, b: {**a, "remote_engine_id": "not-this-engine"},
}


@pytest.mark.core
@pytest.mark.parametrize("forgery", FORGERIES)
def test_forged_pull_params_are_refused(pd, held, forgery):
    a, b = held
    before = metric_values(pd["D"].url)["pdserve:kv_transfer_bytes_received_total"]
    refused(decode(pd, A, FORGERIES[forgery](a, b)), "refused")
    assert metric_values(pd["D"].url)["pdserve:kv_transfer_bytes_received_total"] == before  # not one byte read
    wait_until_idle(pd["D"].url)  # nothing held on D (B's survival is checked by the fixture)


def test_params_without_a_token_are_another_engines(pd, held):
    """pdserve's producers hand out a token with every hold, so parameters without one were made by another
    engine (vLLM NIXL's carry none): D dials nothing, not even P's side channel, and prefills the prompt itself."""
    a, _ = held
    before_d, before_p = metric_values(pd["D"].url), metric_values(pd["P"].url)
    r = decode(pd, A, {k: v for k, v in a.items() if k != "transfer_token"})
    ref = httpx.post(pd["C"].url + "/v1/completions", json={"prompt": A, "max_tokens": 4, "temperature": 0,
                                                            "return_token_ids": True}).json()
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"], r.text
    after_d, after_p = metric_values(pd["D"].url), metric_values(pd["P"].url)
    for name in ("pdserve:kv_transfer_loads_ok_total", "pdserve:kv_transfer_loads_failed_total"):
        assert after_d[name] == before_d[name], name
    for name in ("pdserve:kv_releases_received_total", "pdserve:kv_read_done_received_total",
                 "pdserve:kv_reads_denied_total"):
        assert after_p[name] == before_p[name], name
    assert after_d["pdserve:kv_foreign_params_total"] == before_d["pdserve:kv_foreign_params_total"] + 1
    wait_until_idle(pd["D"].url)


MALFORMED = {
    "huge list": {"remote_block_ids": list(range(100_000))},
    "strings for ids": {"remote_block_ids": ["a", "b"]},
    "negative ids": {"remote_block_ids": [[-1, 2]]},
    "port as text": {"remote_port": "http"},
    "port out of range": {"remote_port": 70000},
    "tensor parallel": {"tp_size": 4},
    "two KV groups": {"remote_block_ids": [[1], [2]]},
    "host is a number": {"remote_host": 12},
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_params_get_a_400(pd, held, case):
    a, _ = held
    r = decode(pd, A, {**a, **MALFORMED[case]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    wait_until_idle(pd["D"].url)


def test_unknown_push_transfer_is_refused(pd):
    """D registers for a transfer P never had: P says so (after its registration deadline), D answers 400."""
    params = {"do_remote_prefill": True, "transfer_mode": "push", "transfer_id": new_transfer_id(),
              "remote_engine_id": pd["P"].ready["engine_id"], "remote_host": "127.0.0.1",
              "remote_port": pd["P"].ready["side_channel_port"]}
    refused(decode(pd, A, params), "no such transfer")
    for name in ("P", "D"):
        idle = wait_until_idle(pd[name].url)
        assert idle["pdserve:kv_transfer_map_size"] == 0 and idle["pdserve:kv_push_expected"] == 0


@pytest.mark.core
def test_rogue_instance_on_the_side_channel_and_data_plane(pd, held):
    """Speaking P's protocols directly: wrong tokens get nothing, and cannot free someone else's KV."""
    a, b = held
    port = pd["P"].ready["side_channel_port"]
    key, blocks = a["remote_request_id"], a["remote_block_ids"][0]

    async def rogue() -> tuple:
        ctx = zmq.asyncio.Context()
        client = SideChannelClient(ctx, "127.0.0.1", port)
        try:
            grant = await client.request(ReadGrant(key=key, token="f" * 32, block_ids=blocks), 5)
            release = await client.request(Release(key=key, token="", reason="rogue"), 5)
            beat = await client.request(Heartbeat(keys=["made-up"]), 5)
            return grant, release, beat
        finally:
            client.close()
            ctx.term()

    grant, release, beat = asyncio.run(rogue())
    assert isinstance(grant, ReadGrantReply) and not grant.ok and grant.refusal == "denied" and not grant.checksums
    assert isinstance(release, Ack) and not release.ok  # a release needs the transfer's token
    assert beat.unknown_keys == ["made-up"]
    assert metric_values(pd["P"].url)["pdserve:kv_leases_held"] == 2

    import torch

    # The rogue speaks P's data plane itself, with a pool of P's block layout: the owner refuses before any byte moves.
    info = pd["P"].ready[f"{pd['plane']}_data_plane"]
    rogue_plane = make_data_plane(pd["plane"], "127.0.0.1")
    shape = (8, *info["shape"][1:]) if "shape" in info else (8, 2, 2, 2, 16, 32)  # tcp's info names no layout
    pool = rogue_plane.allocate(shape, getattr(torch, info.get("dtype", "float32")))
    channel = rogue_plane.connect(info)
    try:
        with pytest.raises(DataPlaneError, match="token"):
            channel.read_blocks(key, "f" * 32, blocks[:1], [0])
        with pytest.raises(DataPlaneError):
            channel.read_blocks(b["remote_request_id"], b["transfer_token"], blocks[:1], [0])  # B's token, A's block
        assert torch.count_nonzero(pool) == 0
    finally:
        channel.close()
        rogue_plane.stop()
