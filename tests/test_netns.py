"""P, D and the gateway on three simulated hosts: each in its own network namespace (P and D in their own PID
namespace too), joined by a bridge, as in a real deployment where no shortcut through one kernel exists.

Answers must equal a colocated instance's; `auto` must not pick shared memory across hosts (the peers share a
kernel and its boot id, not an abstract socket); and a producer killed, or unplugged, in the middle of a push ends
in a recompute on D or a clear error, with no KV block left held on D.
"""

from __future__ import annotations

import json
import os
import random
import uuid
from collections.abc import Iterator

import httpx
import pytest

from netns import Network, NamespacesUnavailable, leftovers
from pdserve.kv_transfer.data_plane import DATA_PLANES
from pdserve.launcher import Process, start, start_instance, stop_all
from server_utils import CROSS_PROCESS_LOGPROB_TOL, metric_values, wait_for, wait_until_idle

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "192", "--served-model-name", "tiny",
          "--max-num-batched-tokens", "16"]


def long_prompt() -> list[int]:
    """30 prefill steps on P (with P's step delay, a window of about six seconds: a loaded box can hold a test's
    thread off for three); each call its own, a rerun's too, so no prefix-cache hit on P or D shortens it."""
    return random.Random().sample(range(1, 2480), 480)


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    try:
        net = Network("gateway", "P", "D")
    except NamespacesUnavailable as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"cannot simulate hosts with network namespaces: {exc}")
    with net:
        yield net
    assert leftovers(net.prefix) == [], "namespaces or links left behind"


@pytest.fixture(scope="module")
def colocated(models) -> Iterator[Process]:
    proc = start_instance(models("qwen3"), *COMMON, name="C")
    yield proc
    proc.stop()


def kv_config(role: str, plane: str, host: str, **extra) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role, "kv_connector_extra_config": {
        "data_plane": plane, "side_channel_host": host, "handshake_timeout": 3.0, "message_timeout": 3.0, **extra}})


@pytest.fixture(scope="module", params=["auto", "tcp", "nixl", "mooncake"])
def fleet(request, network, models) -> Iterator[dict[str, Process]]:
    plane = request.param
    if plane not in ("auto", *DATA_PLANES):
        pytest.skip(f"no {plane} data plane in this build")
    model, gw, p, d = models("qwen3"), network["gateway"], network["P"], network["D"]
    procs: dict[str, Process] = {}
    try:
        # P's steps are slowed (a drill setting) so a test can act while P is partway through a long prefill.
        procs["P"] = start_instance(model, *COMMON, "--kv-transfer-config", kv_config(
            "kv_producer", plane, p.address, kv_lease_duration=5.0, fault_injection={"step_delay_s": 0.2}),
            name="P", host=p.address, wrap=p.wrap())
        procs["D"] = start_instance(model, *COMMON, "--kv-transfer-config", kv_config(
            "kv_consumer", plane, d.address, push_registration_timeout=5.0, kv_load_timeout=5.0),
            name="D", host=d.address, wrap=d.wrap())
        for protocol in ("pull", "push"):
            procs[protocol] = start(f"gateway-{protocol}", [
                "gateway", "--prefill", procs["P"].url, "--decode", procs["D"].url, "--protocol", protocol,
                "--host", gw.address, "--port", "0", "--log-level", "warning"], wrap=gw.wrap(own_pids=False))
        yield {**procs, "plane": plane}
    finally:
        stop_all(procs.values())


@pytest.fixture(autouse=True)
def ends_clean(request, network):
    """Whatever a test did, D holds no KV afterwards (P too, while it lives)."""
    yield
    if "fleet" not in request.fixturenames:
        return
    fleet = request.getfixturevalue("fleet")
    for name in ("D", "P"):
        if fleet[name].alive():
            network["gateway"].call(wait_until_idle, fleet[name].url, timeout=30)


def completion(url: str, body: dict, request_id: str | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=90, headers={"X-Request-Id": request_id or uuid.uuid4().hex},
                      json={"model": "tiny", "temperature": 0, "ignore_eos": True, "logprobs": 1,
                            "return_token_ids": True, **body})


def same_answer(got: dict, expected: dict) -> None:
    x, y = got["choices"][0], expected["choices"][0]
    assert x["token_ids"] == y["token_ids"]
    diffs = [abs(a - b) for a, b in zip(x["logprobs"]["token_logprobs"], y["logprobs"]["token_logprobs"])]
    assert max(diffs) < CROSS_PROCESS_LOGPROB_TOL


def transfer_on_d(network: Network, fleet: dict, request_id: str) -> dict:
    """D's record of how the request's KV arrived (the `kv_transfer_end` event of its timeline)."""
    response = network["gateway"].call(httpx.get, f"{fleet['D'].url}/v1/timeline/{request_id}", timeout=10)
    assert response.status_code == 200, response.text
    [timeline] = response.json()["data"]
    return next(e["attrs"] for e in timeline["events"] if e["name"] == "kv_transfer_end")


def test_p_and_d_are_separate_hosts(network, fleet):
    """Each is the first process of its own PID namespace and listens on its own namespace's address only."""
    for name in ("P", "D"):
        assert fleet[name].ready["pid"] == 1
        assert fleet[name].ready["host"] == network[name].address
        assert fleet[name].ready["side_channel_port"] > 0


@pytest.mark.core
@pytest.mark.parametrize("protocol", ["pull", "push"])
def test_answers_equal_colocated_across_hosts(network, fleet, colocated, protocol):
    for n, body in enumerate(({"prompt": list(range(40, 47)), "max_tokens": 6},
                              {"prompt": list(range(100, 200)), "max_tokens": 6})):
        request_id = f"netns-{fleet['plane']}-{protocol}-{n}-{uuid.uuid4().hex[:6]}"
        answer = network["gateway"].call(completion, fleet[protocol].url, body, request_id)
        assert answer.status_code == 200, answer.text
        same_answer(answer.json(), completion(colocated.url, body).json())
        moved = transfer_on_d(network, fleet, request_id)
        assert moved["ok"] and moved["bytes"] > 0 and moved["mode"] == protocol
        if fleet["plane"] == "auto":
            assert moved["data_plane"] != "shm", "shared memory cannot reach another host"
        else:
            assert moved["data_plane"] == fleet["plane"]


@pytest.mark.parametrize("fleet", ["auto"], indirect=True)
@pytest.mark.parametrize("protocol", ["pull", "push"])
def test_auto_does_not_pick_shm_across_hosts(network, fleet, protocol):
    """Same kernel, same boot id, different hosts: the KV must really arrive, over a plane that reaches P."""
    gw = network["gateway"]
    before = gw.call(metric_values, fleet["D"].url)
    request_id = f"netns-auto-{protocol}-{uuid.uuid4().hex[:6]}"
    prompt = list(range(1000, 1064))
    answer = gw.call(completion, fleet[protocol].url, {"prompt": prompt, "max_tokens": 2}, request_id)
    assert answer.status_code == 200, answer.text
    moved = transfer_on_d(network, fleet, request_id)
    assert moved["ok"] and moved["data_plane"] in DATA_PLANES and moved["data_plane"] != "shm", moved
    after = gw.call(metric_values, fleet["D"].url)
    assert after["pdserve:prompt_tokens_computed_total"] - before["pdserve:prompt_tokens_computed_total"] == 1
    assert after["pdserve:kv_blocks_invalid_total"] == before["pdserve:kv_blocks_invalid_total"]


def long_push_in_flight(network: Network, fleet: dict, prompt: list[int]):
    """Start a long push through the gateway and return (the client's future, D's metrics before) once P is
    writing layers into D and has most of its prefill still ahead."""
    gw = network["gateway"]
    before = {name: gw.call(metric_values, fleet[name].url) for name in ("P", "D")}
    answer = gw.submit(completion, fleet["push"].url, {"prompt": prompt, "max_tokens": 4})
    wait_for(lambda: gw.call(metric_values, fleet["P"].url)["pdserve:kv_push_writes_total"]
             > before["P"]["pdserve:kv_push_writes_total"], timeout=60, what="P to start writing into D")
    assert gw.call(metric_values, fleet["P"].url)["vllm:num_requests_running"] == 1 and \
        gw.call(metric_values, fleet["D"].url)["pdserve:kv_push_done_ok_total"] == \
        before["D"]["pdserve:kv_push_done_ok_total"], "the push ended before the fault could be injected"
    return answer, before["D"]


def recomputed_or_clear_error(answer: httpx.Response, colocated: Process, prompt: list[int]) -> None:
    if answer.status_code == 200:
        same_answer(answer.json(), completion(colocated.url, {"prompt": prompt, "max_tokens": 4}).json())
    else:
        error = answer.json()["error"]
        assert error["message"] and error["type"], answer.text


@pytest.mark.parametrize("fleet", ["auto"], indirect=True)
def test_link_down_mid_push(network, fleet, colocated):
    prompt = long_prompt()
    answer, before = long_push_in_flight(network, fleet, prompt)
    network["P"].set_link(False)
    try:
        wait_for(answer.done, timeout=60, what="the client's answer while P is unplugged")
    finally:
        network["P"].set_link(True)
    recomputed_or_clear_error(answer.result(), colocated, prompt)
    after = network["gateway"].call(metric_values, fleet["D"].url)
    assert after["pdserve:kv_push_done_ok_total"] == before["pdserve:kv_push_done_ok_total"]


@pytest.mark.parametrize("fleet", ["auto"], indirect=True)
def test_sigkill_of_p_mid_push(network, fleet, colocated):
    """Last of the fleet's tests: P stays dead."""
    prompt = long_prompt()
    answer, before = long_push_in_flight(network, fleet, prompt)
    fleet["P"].kill()
    recomputed_or_clear_error(answer.result(60), colocated, prompt)
    after = network["gateway"].call(metric_values, fleet["D"].url)
    assert after["pdserve:kv_push_done_ok_total"] == before["pdserve:kv_push_done_ok_total"]
