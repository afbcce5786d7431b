"""Held KV is never stranded: leases expire, aborts and rejections free it at once, mismatches are refused."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from pdserve.launcher import start_instance, stop_all
from server_utils import metric_values, toy_proxy, wait_until_idle

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "128", "--served-model-name", "tiny"]


def kv_config(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role, "kv_connector_extra_config": extra})


@pytest.fixture(scope="module")
def pair(models):
    """P with a short lease, D whose block reads stall (so a test can abort mid-read), and a colocated reference."""
    model = models("llama")
    procs = []
    try:
        procs.append(start_instance(model, *COMMON, "--kv-transfer-config", kv_config("kv_producer", kv_lease_duration=2.0),
                                    name="P"))
        procs.append(start_instance(model, *COMMON, "--kv-transfer-config",
                                    kv_config("kv_consumer", fault_injection={"read_delay_s": 1.5}), name="D"))
        procs.append(start_instance(model, *COMMON, name="C"))
        yield {"P": procs[0], "D": procs[1], "C": procs[2]}
    finally:
        stop_all(procs)


def prefill(client: httpx.Client, p_url: str, body: dict) -> dict:
    r = client.post(p_url + "/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_lease_expires_when_d_never_reads(pair):
    P = pair["P"]
    with httpx.Client(timeout=30) as client:
        before = metric_values(P.url)
        params = prefill(client, P.url, {"prompt": list(range(40)), "temperature": 0})
        held = metric_values(P.url)
        assert held["pdserve:kv_blocks_in_use"] == len(params["remote_block_ids"][0]) == 3
        assert held["pdserve:kv_leases_held"] == 1
        idle = wait_until_idle(P.url, timeout=10)
    assert idle["pdserve:kv_lease_expired_requests_total"] - before["pdserve:kv_lease_expired_requests_total"] == 1


def test_abort_on_d_while_loading(pair):
    """P frees at once on D's explicit release; D frees its own blocks only after the in-flight read ends."""
    P, D = pair["P"], pair["D"]
    body = {"prompt": list(range(3, 60)), "temperature": 0, "max_tokens": 20}
    with httpx.Client(timeout=30) as client:
        params = prefill(client, P.url, body)
    releases_before = metric_values(P.url)["pdserve:kv_releases_received_total"]
    payload = json.dumps({**body, "kv_transfer_params": params}).encode()
    sock = socket.create_connection(("127.0.0.1", D.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: d\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    wait_for(lambda: metric_values(D.url)["pdserve:kv_blocks_in_use"] > 0, 10, "D to allocate for the load")
    sock.close()  # the client goes away while D is still reading (reads stall 1.5 s here)
    wait_for(lambda: metric_values(P.url)["pdserve:kv_releases_received_total"] > releases_before, 5,
             "P to receive the release")
    assert metric_values(P.url)["pdserve:kv_blocks_in_use"] == 0  # P freed on the message, not on lease expiry
    assert metric_values(D.url)["pdserve:kv_blocks_in_use"] > 0  # D's read is still in flight
    wait_until_idle(D.url, timeout=10)  # and D frees once it ends


def test_rejection_before_admission_frees_p(pair):
    P, D = pair["P"], pair["D"]
    with httpx.Client(timeout=30) as client:
        params = prefill(client, P.url, {"prompt": list(range(20)), "temperature": 0})
        assert metric_values(P.url)["pdserve:kv_blocks_in_use"] > 0
        r = client.post(D.url + "/v1/completions", json={"prompt": list(range(20)), "temperature": -3,
                                                        "kv_transfer_params": params})
        assert r.status_code == 400
        wait_for(lambda: metric_values(P.url)["pdserve:kv_blocks_in_use"] == 0, 1.5, "P to free after D's rejection")


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_compatibility_mismatch_is_refused(pair, models, policy):
    """A D with another block size must not read P's blocks: it recomputes locally (or fails, by policy)."""
    P, C = pair["P"], pair["C"]
    D2 = start_instance(models("llama"), *COMMON, "--block-size", "32", "--kv-transfer-config",
                        json.dumps({"kv_connector": "PdConnector", "kv_role": "kv_consumer",
                                    "kv_load_failure_policy": policy}), name="D-mismatch")
    try:
        refusals = metric_values(P.url)["pdserve:kv_handshake_refusals_total"]
        body = {"prompt": list(range(5, 45)), "temperature": 0, "max_tokens": 8, "ignore_eos": True,
                "return_token_ids": True}
        with httpx.Client(timeout=30) as client:
            d, _ = toy_proxy(client, P.url, D2.url, "/v1/completions", body)
            if policy == "recompute":
                assert d.status_code == 200, d.text
                ref = client.post(C.url + "/v1/completions", json=body).json()
                assert d.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
            else:
                assert d.status_code == 500
                assert "KV cache load" in d.json()["error"]["message"]
        assert metric_values(P.url)["pdserve:kv_handshake_refusals_total"] == refusals + 1
        assert metric_values(D2.url)["pdserve:kv_transfer_loads_failed_total"] == 1
        wait_until_idle(P.url, timeout=5)  # D released P's blocks when it gave up
        wait_until_idle(D2.url)
    finally:
        D2.stop()
