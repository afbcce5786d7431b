"""`--policy kv_aware` with a shared KV store (a real redis-server): the blocks an instance writes to the store are
published as `BlockStored` with medium "STORAGE", indexed as the store's (not the writer's), and credited at
`--kv-store-hit-weight` to every instance that reads that store. A prompt one instance computed is then sent to
another instance of the same store, which never computed it, rather than to one with no store; after the writer
left the fleet. Every answer equals the storeless instance's (recompute)."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kv_routing_utils import ask, legs, live, samples
from pdserve.launcher import start, start_instance, stop_all
from peers import reserved_port
from server_utils import metric_values, wait_for, wait_until_idle
from store_servers import store_server

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "96", "--served-model-name", "tiny"]
EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"})


def prefix(tag: str) -> str:
    """About 200 tokens no other prompt here shares."""
    return " ".join(f"{tag} entry {n} keeps the number {n * 3}." for n in range(18))


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    """A and B read and write one Redis store; C has none. All publish KV events."""
    redis = store_server("redis", tmp_path_factory.mktemp("redis"), "64mb")
    store = ("--kv-transfer-config", json.dumps({"kv_store": {"url": redis.url}}))
    model = models("qwen2")
    with ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(start_instance, model, *COMMON, "--kv-events-config", EVENTS, *args, name=name)
                   for name, args in {"A": store, "B": store, "C": ()}.items()}
    try:
        yield model, {name: future.result() for name, future in futures.items()}
    finally:
        stop_all(future.result() for future in futures.values() if future.exception() is None)
        redis.stop()


def store_blocks(g) -> dict[str, float]:
    return {k: v for k, v in samples(g.url, "pdserve:gateway_kv_index_blocks").items() if k.startswith("store:")}


def test_a_prefix_in_the_store_draws_its_readers_not_the_storeless(fleet):
    model, procs = fleet
    a, b, c = procs["A"], procs["B"], procs["C"]
    admin = reserved_port()
    g = start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--policy", "kv_aware", "--tokenizer",
                          str(model), "--protocol", "colocated", "--both", a.url, b.url, c.url,
                          "--admin-port", str(admin)])
    try:
        wait_for(lambda: live(g, a, b, c), what="live subscriptions")
        for tag in ("S1", "S2"):  # A computes both prefixes, behind the gateway's back, and stores their blocks
            ask(a.url, prefix(tag) + " Then?")
        wait_for(lambda: sum(store_blocks(g).values()) >= 24, what="the stored blocks in the index")
        assert list(store_blocks(g)) == [f"store:{redis_of(a)}"]
        # The writer leaves: what it stored stays in the store, and stays credited to the store's readers.
        assert httpx.post(f"http://127.0.0.1:{admin}/deregister", json={"url": a.url}, timeout=10).status_code == 200
        wait_for(lambda: a.url not in samples(g.url, "pdserve:gateway_kv_index_subscription_state"),
                 what="A to leave the index")
        assert sum(store_blocks(g).values()) >= 24
        hits = metric_values(b.url)["pdserve:kv_store_hit_blocks_total"]
        for tag in ("S1", "S2"):
            rid = f"kv-{uuid.uuid4().hex[:8]}"
            prompt = prefix(tag) + " And then?"
            assert ask(g.url, prompt, rid) == ask(c.url, prompt)
            assert legs(g, rid) == {"colocated": b.url}
        assert metric_values(b.url)["pdserve:kv_store_hit_blocks_total"] >= hits + 24  # B loaded them
        # Prompts nobody stored: B and C cost the same, and the choice goes round between them.
        chosen = set()
        for tag in ("N1", "N2"):
            rid = f"kv-{uuid.uuid4().hex[:8]}"
            ask(g.url, prefix(tag) + " Then?", rid)
            chosen.add(legs(g, rid)["colocated"])
        assert chosen == {b.url, c.url}
        assert metric_values(g.url)["pdserve:gateway_kv_index_decode_errors_total"] == 0
    finally:
        g.stop()
    for instance in (a, b, c):
        wait_until_idle(instance.url)


def redis_of(instance) -> str:
    """The store the instance says its STORAGE events name (its `/v1/pdserve/info`)."""
    return httpx.get(instance.url + "/v1/pdserve/info", timeout=10).json()["kv_events"]["store"]
