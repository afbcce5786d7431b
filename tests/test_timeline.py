"""The request timeline: every process records what happened to a request, served at /v1/timeline/{id}.

One P/D pair behind a pull gateway and a push gateway: each request's events are checked on the gateway, P and D,
in order, with the KV bytes D received, and the three timelines share one clock (same host).
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from pdserve.launcher import start, start_instance, stop_all
from server_utils import metric_values, wait_until_idle

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "128", "--served-model-name", "tiny",
          "--max-num-batched-tokens", "32"]
PROMPTS = {"pull": list(range(10, 80)), "push": list(range(80, 150))}  # 70 tokens: 3 prefill chunks on P


@pytest.fixture(scope="module")
def cluster(models):
    model = models("qwen3")
    kv = lambda role: json.dumps({"kv_connector": "PdConnector", "kv_role": role})  # noqa: E731
    procs = []
    try:
        procs.append(start_instance(model, *COMMON, "--kv-transfer-config", kv("kv_producer"), name="P"))
        procs.append(start_instance(model, *COMMON, "--kv-transfer-config", kv("kv_consumer"), name="D"))
        for protocol in ("pull", "push"):
            procs.append(start(f"gateway-{protocol}", ["gateway", "--prefill", procs[0].url, "--decode", procs[1].url,
                                                       "--protocol", protocol, "--port", "0", "--log-level",
                                                       "warning"]))
        yield {"P": procs[0], "D": procs[1], "pull": procs[2], "push": procs[3]}
    finally:
        stop_all(procs)


def timelines(url: str, request_id: str) -> list[dict]:
    response = httpx.get(f"{url}/v1/timeline/{request_id}", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["data"]


def names(timeline: dict) -> list[str]:
    return [e["name"] for e in timeline["events"]]


def event(timeline: dict, name: str) -> dict:
    return next(e for e in timeline["events"] if e["name"] == name)


def leg_event(timeline: dict, name: str, leg: str) -> dict:
    return next(e for e in timeline["events"] if e["name"] == name and e["attrs"]["leg"] == leg)


def assert_ordered(timeline: dict, expected: list[str]) -> None:
    seen = names(timeline)
    positions = [seen.index(name) for name in expected]
    assert positions == sorted(positions), f"{expected} out of order in {seen}"
    times = [e["time_ns"] for e in timeline["events"]]
    assert times == sorted(times), f"event times go backwards: {seen}"


@pytest.mark.parametrize("protocol", ["pull", "push"])
def test_every_process_records_the_request(cluster, protocol):
    tag = uuid.uuid4()
    request_id = f"tl-{protocol}-{tag.hex[:8]}"
    # Its own prompt, so no prefix-cache hit shortens P's prefill: a first token of its own too, so that a rerun of
    # a failed try does not find the try's prompt cached.
    prompt = [200 + tag.int % 3800, *PROMPTS[protocol][1:]]  # the tiny model has 4,099 ids
    before = {"pull": metric_values(cluster["D"].url)["pdserve:kv_transfer_bytes_received_total"],
              "push": metric_values(cluster["P"].url)["pdserve:kv_push_bytes_sent_total"]}
    answer = httpx.post(cluster[protocol].url + "/v1/completions", headers={"X-Request-Id": request_id}, timeout=60,
                        json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200, answer.text
    for name in ("P", "D"):
        wait_until_idle(cluster[name].url, timeout=15)

    [gateway] = timelines(cluster[protocol].url, request_id)
    assert gateway["role"] == "gateway" and gateway["transfer_id"].startswith("xfer-")
    assert_ordered(gateway, ["arrival", "attempt", "leg_start", "finish"])
    legs = {e["attrs"]["leg"]: e["attrs"]["status"] for e in gateway["events"] if e["name"] == "leg_end"}
    assert legs == {"prefill": 200, "decode": 200}
    for leg, steps in (("prefill", ["leg_start", "leg_end"]), ("decode", ["leg_start", "leg_first_byte", "leg_end"])):
        times = [leg_event(gateway, name, leg)["time_ns"] for name in steps]
        assert times == sorted(times), f"{leg} leg events out of order"
    if protocol == "pull":  # serial: D gets the request only once P answered
        assert leg_event(gateway, "leg_end", "prefill")["time_ns"] <= leg_event(gateway, "leg_start", "decode")["time_ns"]
    assert event(gateway, "finish")["attrs"]["outcome"] == "ok"

    [prefill] = timelines(cluster["P"].url, request_id)
    [decode] = timelines(cluster["D"].url, request_id)
    for timeline, role in ((prefill, "prefill"), (decode, "decode")):
        assert timeline["role"] == role
        assert timeline["transfer_id"] == gateway["transfer_id"], "the gateway's transfer_id names every leg"
        assert timeline["internal_request_id"].startswith(f"cmpl-{request_id}")
    assert prefill["internal_request_id"] != decode["internal_request_id"]

    assert_ordered(prefill, ["arrival", "queued", "scheduled", "prefill_chunk", "first_token", "finish"])
    chunks = [e["attrs"] for e in prefill["events"] if e["name"] == "prefill_chunk"]
    assert sum(c["tokens"] for c in chunks) == len(prompt) and len(chunks) == 3
    assert event(prefill, "finish")["attrs"] == {"reason": "length", "prompt_tokens": len(prompt),
                                                 "completion_tokens": 1}

    assert_ordered(decode, ["arrival", "queued", "kv_transfer_start", "kv_transfer_end", "scheduled", "first_token",
                            "finish"])
    end = event(decode, "kv_transfer_end")["attrs"]
    assert end["ok"] and end["mode"] == protocol
    # D's figure against the metric of the side that moved the bytes (D reads in pull, P writes in push)
    moved_by, metric = {"pull": ("D", "pdserve:kv_transfer_bytes_received_total"),
                        "push": ("P", "pdserve:kv_push_bytes_sent_total")}[protocol]
    moved = metric_values(cluster[moved_by].url)[metric] - before[protocol]
    assert end["bytes"] == moved > 0 and end["data_plane"] == "shm"
    assert event(decode, "finish")["attrs"]["completion_tokens"] == 4

    # One clock: the gateway sent the prefill leg before P saw it, and D's first token came before its end.
    assert leg_event(gateway, "leg_start", "prefill")["time_ns"] <= event(prefill, "arrival")["time_ns"]
    assert event(decode, "first_token")["time_ns"] <= event(gateway, "finish")["time_ns"]


def test_unknown_request_is_a_404(cluster):
    for name in ("P", "pull"):
        response = httpx.get(f"{cluster[name].url}/v1/timeline/never-seen", timeout=10)
        assert response.status_code == 404
        assert "never-seen" in response.json()["error"]["message"]
