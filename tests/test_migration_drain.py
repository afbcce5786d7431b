"""Draining a decode instance moves its running requests to the others (instead of waiting for them), and a rolling
restart of every decode instance under steady streaming load loses nothing: no request failed, none wrong, no
stream cut, nothing held afterwards. Every answer equals the same request unmoved."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from migration_fleet import AUTH, Fleet, Stream, kv_config
from test_migration import body, unmoved
from server_utils import wait_for

PROMPTS = 4  # the load cycles through these (their unmoved answers are computed once)


@pytest.fixture(scope="module")
def fleet(models):
    config = ["--drain-timeout", "60", "--kv-transfer-config", kv_config("kv_consumer")]
    f = Fleet(models("llama"), {"D1": config, "D2": config})
    try:
        yield f
    finally:
        f.stop()


def drain(fleet: Fleet, name: str) -> None:
    """SIGTERM the decode instance: it must drain and exit 0."""
    proc = fleet[name]
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(90) == 0, proc.log_tail()


def test_drain_moves_running_requests_away(fleet):
    requests = [body(seed=40 + i, max_tokens=400) for i in range(3)]
    expected = [unmoved(fleet, r) for r in requests]
    httpx.post(f"{fleet.gateway.url}/deregister", json={"url": fleet["D2"].url}, headers=AUTH)
    streams = [Stream(fleet, r) for r in requests]  # all on D1
    for stream in streams:
        stream.wait_for_events(10)
    httpx.post(f"{fleet.gateway.url}/register", json={"url": fleet["D2"].url, "role": "decode"}, headers=AUTH)
    drain(fleet, "D1")
    results = [s.result() for s in streams]
    for got, want in zip(results, expected, strict=True):
        assert not got["errors"] and got["done"] and got["token_ids"] == want["token_ids"], got["errors"]
        assert got["text"] == want["text"] and got["usage"] == want["usage"]
    # Moved, not finished: 400 tokens at ~100 a second would have kept D1 up for ~4 s.
    assert all(fleet.serving(s.request_id) == "D2" for s in streams), "every request went on at D2"
    fleet.restart("D1")
    fleet.idle()


def test_rolling_restart_under_streaming_load_loses_nothing(fleet):
    requests = [body(seed=50 + i, max_tokens=150, return_token_ids=True) for i in range(PROMPTS)]
    expected = [unmoved(fleet, r) for r in requests]
    results: list[tuple[int, dict]] = []
    stop = threading.Event()

    def client(offset: int) -> None:
        n = offset
        while not stop.is_set():
            index = n % PROMPTS
            results.append((index, Stream(fleet, requests[index]).result()))
            n += 1

    clients = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for thread in clients:
        thread.start()
    wait_for(lambda: len(results) >= 3, 120, "the load to run")
    for name in ("D1", "D2"):
        drain(fleet, name)
        proc = fleet.restart(name)
        wait_for(lambda: _healthy(fleet, proc.url), 60, f"the gateway to route to the new {name}")
        time.sleep(1.0)  # the restarted instance takes requests before the next one drains
    stop.set()
    for thread in clients:
        thread.join(120)
    wrong = [(i, r) for i, r in results if r["token_ids"] != expected[i]["token_ids"] or r["text"] != expected[i]["text"]]
    failed = [r for _, r in results if r["errors"] or not r["done"]]
    assert not failed, failed[:2]
    assert not wrong, wrong[:1]
    assert len(results) >= 6
    fleet.idle()


def _healthy(fleet: Fleet, url: str) -> bool:
    return any(i["url"] == url and i["healthy"] for i in httpx.get(f"{fleet.gateway.url}/instances").json())
