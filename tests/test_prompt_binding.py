"""A transfer is bound to its prompt: P's KV for prompt X never serves a decode request for prompt Y.

Any router or client can pair the wrong legs (the parameters pass through them verbatim). Such a transfer is
refused and handled by D's kv_load_failure_policy: recompute answers Y computed locally, fail answers a clear
error; either way nothing stays held on P or D. The prompts have equal lengths, so block counts match and only
the prompt binding can tell them apart.
"""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.ids import new_transfer_id
from pdserve.launcher import start_instance
from server_utils import metric_values, processes, wait_until_idle

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "192", "--served-model-name", "tiny"]
X, Y = list(range(10, 50)), list(range(400, 440))  # 40 tokens each: three blocks of 16


def kv(role: str, **extra) -> str:
    policy = extra.pop("policy", "recompute")
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role, "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": {"kv_lease_duration": 5.0, **extra}})


@pytest.fixture(scope="module")
def pd(models):
    model = models("llama")

    def instance(name: str, *extra: str):
        return lambda: start_instance(model, *COMMON, *extra, name=name)

    # D recomputes over shared memory (same host); F fails over TCP.
    with processes(P=instance("P", "--kv-transfer-config", kv("kv_producer")),
                   D=instance("D", "--kv-transfer-config", kv("kv_consumer")),
                   F=instance("F", "--kv-transfer-config", kv("kv_consumer", policy="fail", data_plane="tcp")),
                   C=instance("C")) as procs:
        yield procs


@pytest.fixture(autouse=True)
def ends_clean(pd):
    yield
    for name in ("P", "D", "F"):
        idle = wait_until_idle(pd[name].url, timeout=15)
        assert idle["pdserve:kv_leases_held"] == 0 and idle["pdserve:kv_transfer_map_size"] == 0, name
        assert idle.get("pdserve:kv_push_expected", 0) == 0, name


def completion(url: str, prompt: list[int], **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                     "ignore_eos": True, "return_token_ids": True, **body}, timeout=60)


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def check(pd, consumer: str, r: httpx.Response) -> None:
    """Recompute: Y's colocated answer. Fail: a 400 that says what went wrong."""
    if consumer == "D":
        assert tokens(r) == tokens(completion(pd["C"].url, Y))
    else:
        assert r.status_code == 400, r.text
        assert "different prompt" in r.json()["error"]["message"]


def pull_params(pd, prompt: list[int]) -> dict:
    r = completion(pd["P"].url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_matched_pull_still_loads(pd):
    before = metric_values(pd["D"].url)["pdserve:kv_transfer_loads_ok_total"]
    assert tokens(completion(pd["D"].url, X, kv_transfer_params=pull_params(pd, X))) == tokens(
        completion(pd["C"].url, X))
    assert metric_values(pd["D"].url)["pdserve:kv_transfer_loads_ok_total"] == before + 1


@pytest.mark.parametrize("consumer", ["D", "F"])
def test_pull_of_another_prompt_is_refused(pd, consumer):
    params = pull_params(pd, X)
    before = metric_values(pd[consumer].url)["pdserve:kv_transfer_bytes_received_total"]
    check(pd, consumer, completion(pd[consumer].url, Y, kv_transfer_params=params))
    assert metric_values(pd[consumer].url)["pdserve:kv_transfer_bytes_received_total"] == before  # nothing read


@pytest.mark.parametrize("consumer", ["D", "F"])
def test_push_of_another_prompt_is_refused(pd, consumer):
    transfer_id = new_transfer_id()
    p = completion(pd["P"].url, X, max_tokens=1,
                   kv_transfer_params={"do_remote_decode": True, "transfer_mode": "push", "transfer_id": transfer_id})
    assert p.status_code == 200, p.text  # P holds X's KV until a decode instance registers for the transfer
    params = {"do_remote_prefill": True, "transfer_mode": "push", "transfer_id": transfer_id,
              "remote_engine_id": pd["P"].ready["engine_id"], "remote_host": "127.0.0.1",
              "remote_port": pd["P"].ready["side_channel_port"]}
    check(pd, consumer, completion(pd[consumer].url, Y, kv_transfer_params=params))
