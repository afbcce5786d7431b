"""A decode instance dials only allowed peers: forged remote_host / remote_prefill_url outside
kv_connector_extra_config.allowed_peers are a 400 before any connection, with no retries."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from pdserve.ids import new_transfer_id
from pdserve.kv_transfer.peer_policy import PeerNotAllowed, PeerPolicy
from pdserve.launcher import start_instance
from server_utils import metric_values, processes, wait_until_idle

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "64", "--served-model-name", "tiny"]


def kv(**extra) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"data_plane": "tcp", **extra}})


@pytest.fixture(scope="module")
def decoders(models):
    model = models("llama")
    with processes(default=lambda: start_instance(model, *COMMON, "--kv-transfer-config", kv(), name="D"),
                   narrow=lambda: start_instance(model, *COMMON, "--kv-transfer-config",
                                                 kv(allowed_peers=["10.0.0.0/8"]), name="Dn")) as procs:
        yield procs


def pull(host: str, port: int = 5600) -> dict:
    return {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": host, "remote_port": port,
            "remote_request_id": "cmpl-x-0-1234", "remote_block_ids": [[0, 1]], "transfer_token": "t" * 32}


FORGED = {
    "link-local metadata": pull("169.254.169.254", 80),
    "link-local as mapped IPv6": pull("::ffff:169.254.169.254", 80),
    "public address": pull("192.0.2.1"),
    "push to a public address": {"do_remote_prefill": True, "transfer_mode": "push", "transfer_id": new_transfer_id(),
                                 "remote_engine_id": "e", "remote_host": "192.0.2.1", "remote_port": 5600},
    "decode-first to link-local": {"do_remote_prefill": True, "remote_prefill_url": "http://169.254.169.254:80"},
}


def decode(url: str, params: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": list(range(10, 30)), "max_tokens": 2,
                                                     "kv_transfer_params": params}, timeout=60)


def refused(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_transfer_params" and "allowed_peers" in error["message"], error


@pytest.mark.parametrize("case", FORGED)
def test_forged_peer_is_refused_before_any_connection(decoders, case):
    url = decoders["default"].url
    refused(decode(url, FORGED[case]))
    idle = wait_until_idle(url)
    assert idle["pdserve:kv_transfer_loads_failed_total"] == 0  # refused at admission, never attempted
    assert idle["pdserve:decode_first_prefills_total"] == 0 and idle["pdserve:decode_first_fallbacks_total"] == 0


def test_configured_allow_list_is_honoured_and_nothing_is_dialled(decoders):
    """Loopback is outside this instance's list: a listener there must never see a connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(1.0)
    try:
        port = listener.getsockname()[1]
        refused(decode(decoders["narrow"].url, pull("127.0.0.1", port)))
        refused(decode(decoders["narrow"].url, {"do_remote_prefill": True,
                                                "remote_prefill_url": f"http://127.0.0.1:{port}"}))
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert metric_values(decoders["narrow"].url)["pdserve:kv_blocks_in_use"] == 0


def test_policy_rules():
    default = PeerPolicy.from_config(None)
    everything = PeerPolicy.from_config(["0.0.0.0/0", "::/0"])
    metadata = PeerPolicy.from_config(["169.254.169.254/32", "prefill-0.internal"])

    def allowed(policy: PeerPolicy, host: str) -> bool:
        try:
            asyncio.run(policy.check(host))
        except PeerNotAllowed:
            return False
        return True

    for host in ("127.0.0.1", "::1", "10.1.2.3", "172.31.0.1", "192.168.1.1", "fd00::1", "localhost"):
        assert allowed(default, host), host
    for host in ("8.8.8.8", "172.32.0.1", "169.254.169.254", "fe80::1", "0.0.0.0", "no-such-host.invalid"):
        assert not allowed(default, host), host
    # Link-local only when listed as such: a catch-all does not open the metadata service.
    assert allowed(everything, "8.8.8.8") and not allowed(everything, "169.254.169.254")
    assert allowed(metadata, "169.254.169.254") and allowed(metadata, "PREFILL-0.internal")
    assert not allowed(metadata, "127.0.0.1")
    with pytest.raises(ValueError):
        PeerPolicy.from_config("10.0.0.0/8")
