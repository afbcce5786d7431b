"""Injected faults through the gateway (pull, push, decode-first): every request ends correct, or with a clear
error under the `fail` policy; corruption is caught by checksums; nothing stays held."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from pdserve.launcher import start, start_instance, stop_all
from server_utils import data_planes, metric_values, wait_until_idle

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "192", "--served-model-name", "tiny", "--admin-token", "drill"]
ADMIN = {"Authorization": "Bearer drill"}  # /v1/kv/faults is an admin endpoint
FAST = {"fault_injection_api": True, "kv_lease_duration": 2.0, "message_timeout": 1.0, "handshake_timeout": 1.0,
        "push_registration_timeout": 3.0, "kv_load_timeout": 5.0}


def kv(role: str, plane: str, policy: str = "recompute") -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role, "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": {**FAST, "data_plane": plane}})


@pytest.fixture(scope="module", params=data_planes("auto", "nixl", "mooncake"))
def cluster(models, request):
    model = models("llama")
    plane = request.param
    procs = {}
    try:
        procs["P"] = start_instance(model, *COMMON, "--kv-transfer-config", kv("kv_producer", plane), name="P")
        procs["D"] = start_instance(model, *COMMON, "--kv-transfer-config", kv("kv_consumer", plane), name="D")
        procs["Dfail"] = start_instance(model, *COMMON, "--kv-transfer-config", kv("kv_consumer", plane, "fail"),
                                        name="Dfail")
        procs["C"] = start_instance(model, *COMMON, name="C")
        for protocol in ("pull", "push", "decode-first"):
            procs[protocol] = start("gateway", ["gateway", "--prefill", procs["P"].url, "--decode", procs["D"].url,
                                                "--protocol", protocol, "--retries", "0", "--port", "0",
                                                "--log-level", "warning"])
        procs["pull-fail"] = start("gateway", ["gateway", "--prefill", procs["P"].url, "--decode", procs["Dfail"].url,
                                               "--retries", "0", "--port", "0", "--log-level", "warning"])
        yield {**procs, "plane": plane}
    finally:
        stop_all(procs.values())


def set_faults(instance, **faults) -> None:
    r = httpx.post(instance.url + "/v1/kv/faults", json={"seed": 7, **faults}, headers=ADMIN)
    assert r.status_code == 200, r.text


@pytest.fixture(autouse=True)
def clean(cluster):
    yield
    for name in ("P", "D", "Dfail"):
        set_faults(cluster[name])
    for name in ("P", "D", "Dfail"):
        idle = wait_until_idle(cluster[name].url, timeout=15)
        assert idle["pdserve:kv_leases_held"] == 0 and idle["pdserve:kv_transfer_map_size"] == 0


def ask(url: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                                     "temperature": 0, "ignore_eos": True, "return_token_ids": True},
                      timeout=60)


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


PROMPTS = [list(range(3, 3 + n)) for n in (5, 40, 90)]
FAULTS = {
    "message drop": ("both", {"message_drop": 0.3}),
    "message delay": ("both", {"message_delay": 1.0, "message_delay_s": 0.1}),
    "message duplicate": ("both", {"message_duplicate": 1.0}),
    "message reorder": ("both", {"message_reorder": 0.5}),
    "message corrupt": ("both", {"message_corrupt": 0.3}),
    "read or write failure": ("both", {"read_fail": 1.0, "write_fail": 1.0}),
    "lost blocks": ("both", {"block_fail": 0.5}),
    "corrupted block": ("both", {"block_corrupt": 1.0}),
}


@pytest.mark.core
@pytest.mark.parametrize("protocol", ["pull", "push", "decode-first"])
@pytest.mark.parametrize("fault", FAULTS)
def test_injected_fault_still_gives_the_colocated_answer(cluster, protocol, fault):
    if cluster["plane"] != "auto" and fault.startswith("message"):
        pytest.skip("side-channel faults do not touch the data plane: run once, on auto")
    where, faults = FAULTS[fault]
    for name in ("P", "D"):
        set_faults(cluster[name], **faults)
    for i, prompt in enumerate(PROMPTS):
        prompt = [t + 100 * i for t in prompt] + [hash((fault, protocol)) % 4000]  # no prefix reuse across cases
        assert tokens(ask(cluster[protocol].url, prompt)) == tokens(ask(cluster["C"].url, prompt))


@pytest.mark.core
def test_checksums_catch_corruption_and_partial_loads_keep_the_valid_prefix(cluster):
    """Blocks lost in transit fail their checksum; D keeps the valid prefix and recomputes from the first bad one."""
    num_blocks, p_lost = 10, 0.4
    # The injector rolls once per block, in order, from a seeded generator: pick a seed whose first block survives
    # and some later block is lost, and work out where the first loss falls.
    seed = next(s for s in range(1000) if _draws(s, num_blocks)[0] >= p_lost
                and any(d < p_lost for d in _draws(s, num_blocks)))
    first_lost = next(i for i, d in enumerate(_draws(seed, num_blocks)) if d < p_lost)
    httpx.post(cluster["D"].url + "/v1/kv/faults", json={"seed": seed, "block_fail": p_lost}, headers=ADMIN)
    prompt = list(range(1000, 1000 + 16 * num_blocks))
    before = metric_values(cluster["D"].url)
    assert tokens(ask(cluster["pull"].url, prompt)) == tokens(ask(cluster["C"].url, prompt))
    after = metric_values(cluster["D"].url)
    invalid = after["pdserve:kv_blocks_invalid_total"] - before["pdserve:kv_blocks_invalid_total"]
    computed = after["pdserve:prompt_tokens_computed_total"] - before["pdserve:prompt_tokens_computed_total"]
    assert invalid == sum(d < p_lost for d in _draws(seed, num_blocks))  # every lost block was caught
    assert computed == len(prompt) - 16 * first_lost  # the valid prefix was kept


def _draws(seed: int, n: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.random() for _ in range(n)]


@pytest.mark.parametrize("fault", [{"read_fail": 1.0}, {"block_corrupt": 1.0}])
def test_fail_policy_gives_a_clear_error(cluster, fault):
    set_faults(cluster["Dfail"], **fault)
    prompt = list(range(2000, 2050)) if "read_fail" in fault else list(range(2100, 2150))
    r = ask(cluster["pull-fail"].url, prompt)
    assert r.status_code == 500
    assert "KV cache load" in r.json()["error"]["message"]
    set_faults(cluster["Dfail"])
    # The damaged blocks were not kept: the same prompt on D now computes from scratch, correctly.
    r2 = httpx.post(cluster["Dfail"].url + "/v1/completions",
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                          "return_token_ids": True}, timeout=60)
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert tokens(r2) == tokens(ask(cluster["C"].url, prompt))


def test_fault_switch_is_off_unless_allowed(cluster):
    r = httpx.post(cluster["C"].url + "/v1/kv/faults", json={"read_fail": 1.0}, headers=ADMIN)
    assert r.status_code == 404  # a plain instance has no transfer routes at all
    r = httpx.post(cluster["P"].url + "/v1/kv/faults", json={"no_such_fault": 1.0}, headers=ADMIN)
    assert r.status_code == 400
