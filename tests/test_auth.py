"""Who may call what: vLLM's --api-key on instances and the gateway (which forwards a key to its instances), and
the admin endpoints that rewire the cluster, which are off unless an admin token or a loopback admin port is
given, refuse targets no instance can live at, and are logged with the caller's address."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.launcher import start, start_instance, stop_all
from server_utils import metric_values

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "128", "--served-model-name", "tiny"]
KEY = "sk-cluster"
BODY = {"model": "tiny", "prompt": list(range(50, 90)), "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def kv(role: str) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role,
                       "kv_connector_extra_config": {"fault_injection_api": True}})


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_openai_error(r: httpx.Response, status: int, says: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and says in error["message"] and error["type"]


@pytest.fixture(scope="module")
def keyed(models):
    """P (key from --api-key, admin token), D (key from VLLM_API_KEY, no admin access) and C, all with one key."""
    model = models("qwen2")
    procs = {}
    try:
        procs["P"] = start_instance(model, *COMMON, "--kv-transfer-config", kv("kv_producer"), "--api-key", KEY,
                                    "--admin-token", "drill", name="P")
        procs["D"] = start_instance(model, *COMMON, "--kv-transfer-config", kv("kv_consumer"), name="D",
                                    env={"VLLM_API_KEY": KEY})
        procs["C"] = start_instance(model, *COMMON, "--api-key", "other", KEY, name="C")
        yield procs
    finally:
        stop_all(procs.values())


def test_instances_take_vllms_api_key(keyed):
    for name in ("P", "D", "C"):
        url = keyed[name].url
        assert_openai_error(httpx.post(url + "/v1/completions", json=BODY, timeout=60), 401, "API key")
        assert_openai_error(httpx.post(url + "/v1/completions", json=BODY, headers=bearer("wrong"), timeout=60),
                            401, "API key")
        assert httpx.get(url + "/v1/models").status_code == 401
        for open_path in ("/health", "/metrics", "/version"):
            assert httpx.get(url + open_path).status_code == 200, open_path
        assert httpx.post(url + "/v1/completions", json=BODY, headers=bearer(KEY), timeout=60).status_code == 200
    assert httpx.post(keyed["C"].url + "/v1/completions", json=BODY, headers=bearer("other"),
                      timeout=60).status_code == 200  # any of several keys


@pytest.mark.parametrize("protocol", ["pull", "push", "decode-first"])
def test_gateway_takes_the_key_and_forwards_one(keyed, protocol):
    """Clients need the gateway's key; the gateway reaches keyed instances (legs, side-channel info, releases,
    and D's own call to P in decode-first) with --instance-api-key."""
    g = start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--protocol", protocol,
                          "--prefill", keyed["P"].url, "--decode", keyed["D"].url,
                          "--api-key", "sk-gateway", "--instance-api-key", KEY])
    try:
        expected = httpx.post(keyed["C"].url + "/v1/completions", json=BODY, headers=bearer(KEY), timeout=60).json()
        assert_openai_error(httpx.post(g.url + "/v1/completions", json=BODY, timeout=60), 401, "API key")
        assert_openai_error(httpx.post(g.url + "/v1/completions", json=BODY, headers=bearer(KEY), timeout=60),
                            401, "API key")  # the instances' key is not the gateway's
        assert httpx.get(g.url + "/health").status_code == 200 and httpx.get(g.url + "/metrics").status_code == 200
        r = httpx.post(g.url + "/v1/completions", json=BODY, headers=bearer("sk-gateway"), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected["choices"][0]["text"]
        if protocol == "decode-first":  # D really asked P (it did not fall back to prefilling itself)
            metrics = metric_values(keyed["D"].url)
            assert metrics["pdserve:decode_first_fallbacks_total"] == 0
            assert metrics["pdserve:decode_first_prefills_total"] >= 1
    finally:
        g.stop()


def test_a_gateway_without_the_instances_key_says_so(keyed):
    """The client's key is right; the instances refuse the gateway: a 502 naming the flag, not the client's 401."""
    g = start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--prefill", keyed["P"].url,
                          "--decode", keyed["D"].url, "--api-key", "sk-gateway"])
    try:
        r = httpx.post(g.url + "/v1/completions", json=BODY, headers=bearer("sk-gateway"), timeout=60)
        assert_openai_error(r, 502, "--instance-api-key")
    finally:
        g.stop()


def test_instance_fault_switch_is_an_admin_endpoint(keyed):
    faults = {"read_fail": 0.0}
    assert_openai_error(httpx.post(keyed["D"].url + "/v1/kv/faults", json=faults, headers=bearer(KEY)), 403,
                        "--admin-token")  # neither admin flag: off, and the answer says how to turn it on
    assert_openai_error(httpx.post(keyed["P"].url + "/v1/kv/faults", json=faults, headers=bearer(KEY)), 401,
                        "admin token")  # the client key is no admin token
    assert httpx.post(keyed["P"].url + "/v1/kv/faults", json=faults, headers=bearer("drill")).status_code == 200
    assert "set fault injection" in keyed["P"].log_tail()


@pytest.fixture()
def fakes(recorded):
    start_fake, _ = recorded
    return start_fake("P"), start_fake("D")


def gateway(*args: str):
    return start("gateway", ["gateway", "--port", "0", "--log-level", "info", *args])


def registered(g) -> set[str]:
    return {i["url"] for i in httpx.get(g.url + "/instances").json()}


def test_admin_endpoints_are_off_by_default(fakes):
    p, d = fakes
    g = gateway("--prefill", p.url)
    try:
        for path, body in (("/register", {"url": d.url, "role": "decode"}), ("/deregister", {"url": p.url})):
            assert_openai_error(httpx.post(g.url + path, json=body), 403, "--admin-token")
        assert registered(g) == {p.url}
        assert "refused admin POST /register from 127.0.0.1:" in g.log_tail()
    finally:
        g.stop()


def test_admin_token_guards_registration_and_refuses_metadata_targets(fakes):
    p, d = fakes
    g = gateway("--prefill", p.url, "--api-key", "sk-client", "--admin-token", "adm1n")
    try:
        body = {"url": d.url, "role": "decode"}
        for headers in ({}, bearer("wrong"), bearer("sk-client")):
            assert_openai_error(httpx.post(g.url + "/register", json=body, headers=headers), 401, "admin token")
        for target in ("http://169.254.169.254:80", "http://[fe80::1]:80", "http://224.0.0.1:80",
                       "http://0.0.0.0:8000", "http://[::ffff:169.254.169.254]:80"):
            r = httpx.post(g.url + "/register", json={"url": target, "role": "decode"}, headers=bearer("adm1n"))
            assert_openai_error(r, 400, "refused")
        assert httpx.post(g.url + "/register", json=body, headers=bearer("adm1n")).status_code == 200
        assert httpx.get(g.url + "/instances", headers=bearer("sk-client")).status_code == 200
        assert httpx.post(g.url + "/deregister", json={"url": p.url}, headers=bearer("adm1n")).status_code == 200
        log = g.log_tail(20000)
        assert f"registered decode instance {d.url}" in log and f"deregistered {p.url}" in log
        assert "admin: 127.0.0.1:" in log and "tried to register decode http://169.254.169.254:80" in log
    finally:
        g.stop()


def test_admin_port_serves_admin_endpoints_on_loopback_only(fakes):
    p, d = fakes
    g = gateway("--prefill", p.url, "--admin-port", "0")
    admin = f"http://127.0.0.1:{g.ready['admin_port']}"
    try:
        body = {"url": d.url, "role": "decode"}
        assert_openai_error(httpx.post(g.url + "/register", json=body), 403, "admin port")
        assert httpx.post(admin + "/register", json=body).status_code == 200
        assert registered(g) == {p.url, d.url}
        r = httpx.post(admin + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 404  # no client traffic on the admin port
    finally:
        g.stop()
