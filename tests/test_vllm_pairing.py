"""vLLM in the fleet, live: vLLM-CPU instances with the NixlConnector beside pdserve instances behind one gateway.

What must hold: a protocol is used only with pairs that can serve it (decode-first and push never reach vLLM; a
mixed pool pairs vLLM with vLLM and pdserve with pdserve, whatever order the policy walks); a pdserve decode
instance given a vLLM producer's kv_transfer_params never dials vLLM's side channel; and afterwards the vLLM
producer still hands KV to a vLLM decode instance that never met it (one stray message on vLLM's side channel
kills its listener, which only a fresh consumer's handshake would notice).

Each vLLM process busy-polls a core, so the module keeps one vLLM P and one vLLM D, and starts a second D only at
the very end, after stopping the first. The tests run in file order: the first one needs a vLLM D that has not
yet handshaken with the vLLM P.
"""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import random_prompt
from pdserve.launcher import LaunchError, start, start_instance, stop_all
from peers import reserved_port
from server_utils import metric_values, toy_proxy
from vllm_live import ready, start_vllm, vllm_pulled

pytestmark = pytest.mark.vllm

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "128", "--served-model-name", "tiny"]
# 10 tokens fit one pdserve block (D would handshake with P); 40 need three pdserve blocks but one vLLM block of
# 128 (D would see too few blocks); 150 span two vLLM blocks.
PROMPTS = [random_prompt(10, 1), random_prompt(40, 2), random_prompt(150, 3)]
# Prompts no instance has seen (so no prefix cache changes what moves), of lengths around block boundaries.
MIXED = [random_prompt(n, 10 + i) for i, n in enumerate((12, 16, 33, 64, 100, 128, 140, 200))]
VLLM_ONLY = "vLLM instances take part in pull only"


def pd_config(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role, **extra})


@pytest.fixture(scope="module")
def fleet(models):
    model = models("llama")
    procs = {}
    try:
        # vLLM starts slowly: both at once, and the pdserve instances meanwhile.
        procs["vP"] = start_vllm(model, role="kv_producer", name="vP", wait=False)
        procs["vD"] = start_vllm(model, role="kv_consumer", name="vD", wait=False)
        for name, config in (("pP", pd_config("kv_producer")), ("pD", pd_config("kv_consumer")),
                             ("pD_fail", pd_config("kv_consumer", kv_load_failure_policy="fail"))):
            procs[name] = start_instance(model, *COMMON, "--kv-transfer-config", config, name=name)
        ready(procs["vP"])
        ready(procs["vD"])
        yield procs
    finally:
        stop_all(procs.values())


def body(prompt: list[int], **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def colocated(url: str, prompt: list[int]) -> str:
    """The oracle: the same engine serving the request alone (no kv_transfer_params)."""
    return text_of(httpx.post(f"{url}/v1/completions", json=body(prompt), timeout=120))


def vllm_prefill(vp_url: str, prompt: list[int]) -> dict:
    """vLLM P's own kv_transfer_params for this prompt (it now holds the KV until read or its lease runs out)."""
    r = httpx.post(f"{vp_url}/v1/completions", json=body(prompt, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False}), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def assert_vllm_pair_works(vp_url: str, vd_url: str, prompt: list[int]) -> None:
    """vLLM D pulls the prompt's KV from vLLM P (as vLLM's toy proxy drives them) and answers as colocated."""
    pulled = vllm_pulled(vd_url)
    with httpx.Client(timeout=120) as client:
        response, _ = toy_proxy(client, vp_url, vd_url, "/v1/completions", body(prompt))
    assert text_of(response) == colocated(vp_url, prompt)
    assert vllm_pulled(vd_url) - pulled == len(prompt)


def gateway(*args: str):
    return start("gateway", ["gateway", "--port", "0", "--log-level", "warning", *args])


def test_vllm_params_given_to_a_pdserve_decode_are_foreign(fleet):
    """pdserve D never dials vLLM's side channel: under recompute it prefills at once (no load tried, so no
    stall), under fail it refuses clearly; and vLLM P still serves a vLLM D that meets it only afterwards."""
    vp, pd, pd_fail = fleet["vP"].url, fleet["pD"].url, fleet["pD_fail"].url
    for prompt in PROMPTS[:2]:
        expected = colocated(fleet["pP"].url, prompt)
        params = vllm_prefill(vp, prompt)
        before = metric_values(pd)
        assert text_of(httpx.post(f"{pd}/v1/completions", json=body(prompt, kv_transfer_params=params),
                                  timeout=120)) == expected
        after = metric_values(pd)
        for name in ("pdserve:kv_transfer_loads_ok_total", "pdserve:kv_transfer_loads_failed_total",
                     "pdserve:kv_handshake_refusals_total"):
            assert after[name] == before[name], name  # nothing was attempted against vLLM P
        assert after["pdserve:kv_foreign_params_total"] - before["pdserve:kv_foreign_params_total"] == 1
        refused = httpx.post(f"{pd_fail}/v1/completions", json=body(prompt, kv_transfer_params=params), timeout=120)
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert "not a pdserve instance" in message and params["remote_engine_id"] in message
    assert_vllm_pair_works(vp, fleet["vD"].url, PROMPTS[2])


@pytest.mark.parametrize("protocol", ["decode-first", "push"])
def test_pdserve_only_protocols_are_refused_with_vllm(fleet, protocol):
    """A pool of vLLM instances cannot serve decode-first or push: the gateway will not start; with an instance
    still unidentified it starts, and answers 503 saying why, and sends vLLM nothing it cannot take."""
    vp, vd = fleet["vP"].url, fleet["vD"].url
    with pytest.raises(LaunchError) as startup:
        gateway("--prefill", vp, "--decode", vd, "--protocol", protocol)
    assert f"can serve the {protocol} protocol" in str(startup.value) and VLLM_ONLY in str(startup.value)
    not_up_yet = f"http://127.0.0.1:{reserved_port()}"
    g = gateway("--prefill", vp, not_up_yet, "--decode", vd, "--protocol", protocol)
    try:
        r = httpx.post(f"{g.url}/v1/completions", json=body(PROMPTS[0]), timeout=60)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert protocol in message and VLLM_ONLY in message and "vllm 0.32" in message, message
        health = httpx.get(f"{g.url}/health", timeout=10)
        assert health.status_code == 503 and VLLM_ONLY in health.json()["error"]["message"]
    finally:
        g.stop()
    assert_vllm_pair_works(vp, vd, PROMPTS[1])


def legs(gateway_url: str, request_id: str) -> dict[str, str]:
    """Which instance served each leg of a request, from the gateway's timeline."""
    (timeline,) = httpx.get(f"{gateway_url}/v1/timeline/{request_id}", timeout=10).json()["data"]
    return {e["attrs"]["leg"]: e["attrs"]["url"] for e in timeline["events"] if e["name"] == "leg_start"}


def instance_info(gateway_url: str) -> dict[str, dict[str, str]]:
    families = text_string_to_metric_families(httpx.get(f"{gateway_url}/metrics", timeout=10).text)
    family = next(f for f in families if f.name == "pdserve:gateway_instance_info")
    return {s.labels["instance"]: s.labels for s in family.samples}


def test_mixed_pool_pairs_like_with_like(fleet, models):
    """vLLM P/D and pdserve P/D behind one gateway: every answer equals its engine's colocated answer, KV really
    moved in every request, nothing failed or waited for a timeout; afterwards a fresh vLLM D pulls from vLLM P."""
    vp, vd, pp, pd = (fleet[n].url for n in ("vP", "vD", "pP", "pD"))
    kind = {vp: "vllm", vd: "vllm", pp: "pdserve", pd: "pdserve"}
    # Round robin walks both lists by index, so without pairing every request would cross vP with pD, pP with vD.
    g = gateway("--prefill", vp, pp, "--decode", pd, vd, "--policy", "round_robin", "--protocol", "pull")
    try:
        expected = {(k, i): colocated(url, p) for k, url in (("vllm", vp), ("pdserve", pp))
                    for i, p in enumerate(MIXED)}
        before_pd, pulled_vd = metric_values(pd), vllm_pulled(vd)
        kinds: list[str] = []  # which engine served each request
        for i, prompt in enumerate(MIXED):
            request_id = f"mixed-{i}"
            r = httpx.post(f"{g.url}/v1/completions", json=body(prompt), headers={"X-Request-Id": request_id},
                           timeout=120)
            used = legs(g.url, request_id)
            assert kind[used["prefill"]] == kind[used["decode"]], used
            assert text_of(r) == expected[(kind[used["decode"]], i)]
            kinds.append(kind[used["decode"]])
        assert set(kinds) == {"vllm", "pdserve"}
        after_pd = metric_values(pd)
        assert after_pd["pdserve:kv_transfer_loads_ok_total"] - before_pd["pdserve:kv_transfer_loads_ok_total"] \
            == kinds.count("pdserve")  # every pdserve-served request moved its KV
        for name in ("pdserve:kv_transfer_loads_failed_total", "pdserve:kv_foreign_params_total"):
            assert after_pd[name] == before_pd[name], name
        assert vllm_pulled(vd) - pulled_vd == sum(len(p) for p, used in zip(MIXED, kinds) if used == "vllm")
        info = instance_info(g.url)
        for url in (vp, vd):
            assert (info[url]["engine"], info[url]["kv_connector"], info[url]["protocols"]) == (
                "vllm", "NixlConnector", "pull") and info[url]["version"].startswith("0.32")
        for url in (pp, pd):
            assert info[url]["engine"] == "pdserve" and info[url]["kv_connector"] == "PdConnector"
            assert set(info[url]["protocols"].split(",")) == {"decode-first", "pull", "push"}
    finally:
        g.stop()
    fleet["vD"].stop()  # at most two vLLM processes at once
    fresh = start_vllm(models("llama"), role="kv_consumer", name="vD2")
    try:
        assert_vllm_pair_works(vp, fresh.url, PROMPTS[2])
    finally:
        fresh.stop()
