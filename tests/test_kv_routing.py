"""`--policy kv_aware` with live pdserve instances publishing KV events: colocated routing by where a prefix is
cached, prefill candidates in pull, conditional disaggregation by D's indexed cache, an instance restarted and one
killed mid-run, registration with a publisher and departure. Every answer equals the colocated one."""

from __future__ import annotations

import json
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.kv_events import native
from pdserve.launcher import start, start_instance, stop_all
from kv_routing_utils import ask, indexed, legs, live, samples
from peers import reserved_port
from server_utils import metric_values, wait_for, wait_until_idle

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "96", "--served-model-name", "tiny"]
EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"})


def kv(role: str) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role})


def prefix(tag: str) -> str:
    """About 200 tokens no other test's prompt shares."""
    return " ".join(f"{tag} record {n} holds the value {n * 7}." for n in range(18))


@pytest.fixture(scope="module")
def model(models):
    return models("qwen2")


@pytest.fixture(scope="module")
def fleet(model):
    """Two colocated instances and a 2P1D pull set, all publishing; started side by side (imports overlap)."""
    extra = {"A": (), "B": (), "P1": ("--kv-transfer-config", kv("kv_producer")),
             "P2": ("--kv-transfer-config", kv("kv_producer")), "D": ("--kv-transfer-config", kv("kv_consumer"))}
    procs = {}
    with ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(start_instance, model, *COMMON, "--kv-events-config", EVENTS, *args, name=name)
                   for name, args in extra.items()}
    try:
        for name, future in futures.items():
            procs[name] = future.result()
        yield procs
    finally:
        stop_all(future.result() for future in futures.values() if future.exception() is None)


def gateway(model, *args: str):
    return start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--policy", "kv_aware",
                             "--tokenizer", str(model), *args])


def test_colocated_requests_go_where_their_prefix_is_cached(model, fleet):
    a, b = fleet["A"], fleet["B"]
    g = gateway(model, "--protocol", "colocated", "--both", a.url, b.url)
    try:
        wait_for(lambda: live(g, a, b), what="live subscriptions")
        for instance in (a, b):  # each instance computes a prompt of its own, behind the gateway's back
            ask(instance.url, prefix(instance.name) + " Then?")
            wait_for(lambda inst=instance: indexed(g, inst) >= 12, what=f"{instance.name}'s blocks in the index")
        for instance in (b, a):
            rid = f"kv-{uuid.uuid4().hex[:8]}"
            prompt = prefix(instance.name) + " And after that?"
            assert ask(g.url, prompt, rid) == ask(fleet["B" if instance is not b else "A"].url, prompt)
            assert legs(g, rid) == {"colocated": instance.url}
        text = httpx.get(g.url + "/metrics", timeout=10).text
        assert 'pdserve:gateway_kv_index_events_applied_total{type="BlockStored"}' in text
        built = native.load() is not None  # make install builds the C core; the gateway takes it when it is
        assert metric_values(g.url)["pdserve:gateway_kv_index_native"] == float(built)
        assert built or os.environ.get("CI") != "true"
    finally:
        g.stop()


def test_prefill_candidates_and_conditional_disaggregation_use_the_index(model, fleet):
    p1, p2, d = fleet["P1"], fleet["P2"], fleet["D"]
    g = gateway(model, "--protocol", "pull", "--prefill", p1.url, p2.url, "--decode", d.url, "--conditional",
                "--min-prompt-tokens", "16")
    try:
        wait_for(lambda: live(g, p1, p2, d), what="live subscriptions")
        ask(p2.url, prefix("P2") + " Then?")  # P2 alone holds this prefix
        wait_for(lambda: indexed(g, p2) >= 12, what="P2's blocks in the index")
        prompt = prefix("P2") + " Next?"
        rid = f"kv-{uuid.uuid4().hex[:8]}"
        expected = ask(fleet["A"].url, prompt)
        assert ask(g.url, prompt, rid) == expected
        assert legs(g, rid) == {"prefill": p2.url, "decode": d.url}
        # D loaded that prompt's KV and cached it: the same prompt again is D's alone.
        wait_for(lambda: indexed(g, d) >= 12, what="D's blocks in the index")
        rid = f"kv-{uuid.uuid4().hex[:8]}"
        assert ask(g.url, prompt, rid) == expected
        assert legs(g, rid) == {"decode": d.url}
        assert 'decision="local_prefill",reason="decode_holds_prefix"} 1.0' in httpx.get(g.url + "/metrics").text
    finally:
        g.stop()
    for instance in (p1, p2, d):
        wait_until_idle(instance.url)


def test_restarted_and_killed_instances(model, fleet, tmp_path):
    """R publishes over ipc sockets and is registered at run time with its publisher (as a vLLM instance would
    be); it is killed and restarted on the same port and sockets (its sequence restarts), then killed for good and
    deregistered. The index never credits blocks of an engine that is gone, and no request goes to it."""
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/r.pub",
                         "replay_endpoint": f"ipc://{tmp_path}/r.replay"})
    port = reserved_port()

    def start_r():
        return start("R", ["serve", str(model), "--host", "127.0.0.1", "--port", str(port), *COMMON,
                           "--kv-events-config", events])

    admin = reserved_port()
    a = fleet["A"]
    g = gateway(model, "--protocol", "colocated", "--both", a.url, "--admin-port", str(admin))
    r = start_r()
    try:
        publisher = {"endpoint": f"ipc://{tmp_path}/r.pub", "replay_endpoint": f"ipc://{tmp_path}/r.replay"}
        reply = httpx.post(f"http://127.0.0.1:{admin}/register", json={"url": r.url, "role": "both",
                                                                      "kv_events": publisher}, timeout=30)
        assert reply.status_code == 200, reply.text
        bad = httpx.post(f"http://127.0.0.1:{admin}/register", json={"url": r.url, "kv_events": {"endpoint": 5}})
        assert bad.status_code == 400
        wait_for(lambda: live(g, a, r), what="live subscriptions")
        ask(r.url, prefix("R") + " Then?")
        wait_for(lambda: indexed(g, r) >= 12, what="R's blocks in the index")
        r.kill()
        wait_for(lambda: indexed(g, r) == 0, what="the dead engine's blocks to leave the index")
        prompt = prefix("R") + " Next?"
        for _ in range(3):  # never to the dead instance (a refused connection is retried on A)
            rid = f"kv-{uuid.uuid4().hex[:8]}"
            ask(g.url, prompt, rid)
            assert legs(g, rid).get("colocated") == a.url
        r = start_r()
        wait_for(lambda: live(g, r), timeout=30, what="R's events again")
        assert indexed(g, r) == 0  # a new engine: nothing of the old one's cache is credited
        assert samples(g.url, "pdserve:gateway_kv_index_replays_total")[r.url] >= 2
        r.kill()
        gone = httpx.post(f"http://127.0.0.1:{admin}/deregister", json={"url": r.url}, timeout=10)
        assert gone.status_code == 200
        wait_for(lambda: r.url not in samples(g.url, "pdserve:gateway_kv_index_subscription_state"),
                 what="R to leave the index")
        assert metric_values(g.url)["pdserve:gateway_kv_index_decode_errors_total"] == 0
    finally:
        r.stop()
        g.stop()
