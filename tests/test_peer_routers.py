"""A router nobody here wrote (vllm-router, in --vllm-pd-disaggregation mode) in front of pdserve P and D."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from pdserve.launcher import start_instance, stop_all
from peers import peer_binary, reserved_port, stop, wait_healthy
from server_utils import metric_values, sse_events, wait_until_idle

pytestmark = pytest.mark.peer

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "128", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def stack(models):
    router_exe = peer_binary("vllm-router", "vllm-router")
    model = models("qwen3")
    procs, router = [], None
    try:
        for name, role in (("P", "kv_producer"), ("D", "kv_consumer")):
            procs.append(start_instance(model, *COMMON, "--kv-transfer-config",
                                        json.dumps({"kv_connector": "PdConnector", "kv_role": role}), name=name))
        procs.append(start_instance(model, *COMMON, name="C"))
        port = reserved_port()
        router = subprocess.Popen(
            [str(router_exe), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
             "--prefill", procs[0].url, "--decode", procs[1].url, "--policy", "round_robin",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(reserved_port()), "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, router)
        yield {"router": url, "P": procs[0], "D": procs[1], "C": procs[2]}
    finally:
        if router is not None:
            stop(router)
        stop_all(procs)


@pytest.mark.parametrize("prompt", ["one", "vllm-router drives pdserve instances as if they were vLLM",
                                    " ".join(["long prompt"] * 40)])
def test_vllm_router_completion_equals_colocated(stack, prompt):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    loads_before = metric_values(stack["D"].url)["pdserve:kv_transfer_loads_ok_total"]
    routed = httpx.post(stack["router"] + "/v1/completions", json=body, timeout=60)
    assert routed.status_code == 200, routed.text
    ref = httpx.post(stack["C"].url + "/v1/completions", json=body, timeout=60).json()
    assert routed.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    # The KV really came from P (not a silent local prefill on D).
    assert metric_values(stack["D"].url)["pdserve:kv_transfer_loads_ok_total"] == loads_before + 1
    for name in ("P", "D"):
        wait_until_idle(stack[name].url)


def test_vllm_router_streamed_chat_equals_colocated(stack):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello router"}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", stack["router"] + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        text = "".join(c["delta"].get("content", "") for e in sse_events(r) for c in e["choices"])
    ref = httpx.post(stack["C"].url + "/v1/chat/completions", json=body, timeout=60).json()
    assert text == ref["choices"][0]["message"]["content"]
    for name in ("P", "D"):
        wait_until_idle(stack[name].url)
