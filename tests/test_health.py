"""The gateway's view of health: an instance's error answer is one client's business; only transport failures,
timeouts and failed health checks open an instance's circuit breaker, and a half-open check closes it again.

Fake vLLM instances (tests/fake_vllm.py) play the parts a real engine cannot be made to play on demand: a
connection closed right after an error answer, a /health that answers late while everything else is fast, a
process killed and restarted at the same address.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import start
from peers import reserved_port
from server_utils import wait_for


def gateway(*args: str, config: dict | None = None, tmp_path=None):
    extra = []
    if config is not None:
        path = tmp_path / "gateway.json"
        path.write_text(json.dumps(config))
        extra = ["--config", str(path)]
    return start("gateway", ["gateway", "--port", "0", "--log-level", "info", *extra, *args])


def ask(url: str, prompt: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 3}, timeout=30)


def samples(url: str, name: str, **match: str) -> float:
    """The sum of one metric's samples whose labels include `match`."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in match.items()):
                total += sample.value
    return total


def test_an_error_answer_for_one_client_never_takes_the_instance_away(recorded):
    """P answers a poisoned prompt with a 500 and then closes the connection (as uvicorn does after an unhandled
    exception). That client gets P's own status and message; every other client keeps being served."""
    start_fake, _ = recorded
    p, d = start_fake("P", "--poison", "poison"), start_fake("D")
    g = gateway("--prefill", p.url, "--decode", d.url, "--retries", "1")
    try:
        for _ in range(10):  # one after the other: the worst case for a connection reused at once
            bad = ask(g.url, "poison")
            assert bad.status_code == 500 and bad.json()["error"]["message"] == "poisoned prompt"
            good = ask(g.url, "hello")
            assert good.status_code == 200, good.text
        with ThreadPoolExecutor(8) as pool:  # and interleaved
            answers = list(pool.map(lambda i: ask(g.url, "poison" if i % 2 else "hello"), range(40)))
        assert [r.status_code for r in answers] == [200, 500] * 20
        assert samples(g.url, "pdserve:gateway_breaker_transitions_total", to="open") == 0
        assert samples(g.url, "pdserve:gateway_breaker_state", instance=p.url, state="closed") == 1
    finally:
        g.stop()


def test_a_killed_instance_opens_its_breaker_and_a_restarted_one_closes_it(recorded, tmp_path):
    start_fake, received = recorded
    port = reserved_port()
    p1, p2, d = start_fake("P1", "--port", str(port)), start_fake("P2"), start_fake("D")
    # Health checks of closed breakers are a minute apart: only the requests themselves can open P1's.
    config = {"probe_interval_s": 60.0, "breaker_failures": 2, "breaker_open_s": 0.3}
    g = gateway("--prefill", p1.url, p2.url, "--decode", d.url, "--policy", "round_robin", "--retries", "1",
                config=config, tmp_path=tmp_path)
    try:
        assert all(ask(g.url, "warm").status_code == 200 for _ in range(4))
        p1.kill()
        for _ in range(12):  # each request that picks P1 fails over to P2: no client sees the loss
            assert ask(g.url, "after the kill").status_code == 200
        failures = samples(g.url, "pdserve:gateway_leg_failures_total", leg="prefill", reason="connection")
        assert failures == 2  # exactly N transport failures, then no more traffic to P1
        assert samples(g.url, "pdserve:gateway_breaker_transitions_total", instance=p1.url,
                       **{"from": "closed", "to": "open"}) == 1
        wait_for(lambda: samples(g.url, "pdserve:gateway_breaker_transitions_total", instance=p1.url,
                                 **{"from": "half_open", "to": "open"}) >= 1, what="a failed half-open check")
        served_by_p1 = len(received("P1"))
        start_fake("P1", "--port", str(port))
        wait_for(lambda: samples(g.url, "pdserve:gateway_breaker_state", instance=p1.url, state="closed") == 1,
                 what="the half-open check to close P1's breaker")
        assert samples(g.url, "pdserve:gateway_breaker_transitions_total", instance=p1.url,
                       **{"from": "half_open", "to": "closed"}) == 2  # at startup, and now
        assert all(ask(g.url, "back").status_code == 200 for _ in range(4))
        assert len(received("P1")) > served_by_p1  # P1 takes its share again
    finally:
        g.stop()


def test_slow_health_checks_do_not_drop_an_instance_that_serves(recorded, tmp_path):
    """/health answers after 1 s, the gateway waits 0.3 s: while requests succeed the breaker stays closed and no
    client sees a 503; once traffic stops, the same slow checks do count, and the breaker opens."""
    start_fake, _ = recorded
    p, d = start_fake("P"), start_fake("D")
    config = {"probe_interval_s": 0.2, "health_timeout_s": 0.3, "breaker_failures": 2, "liveness_window_s": 1.0}
    g = gateway("--prefill", p.url, "--decode", d.url, config=config, tmp_path=tmp_path)
    try:
        assert ask(g.url, "idle").status_code == 200
        httpx.post(p.url + "/fake/health-delay", json={"seconds": 1.0}).raise_for_status()  # now it is busy
        deadline = time.monotonic() + 4.0
        statuses = set()
        while time.monotonic() < deadline:  # steady traffic, for many health-check intervals
            statuses.add(ask(g.url, "busy").status_code)
            time.sleep(0.05)
        assert statuses == {200}
        assert samples(g.url, "pdserve:gateway_health_checks_total", instance=p.url, result="slow_but_serving") >= 3
        assert samples(g.url, "pdserve:gateway_breaker_state", instance=p.url, state="closed") == 1
        wait_for(lambda: samples(g.url, "pdserve:gateway_breaker_state", instance=p.url, state="open") == 1,
                 timeout=20, what="idle slow health checks to open the breaker")
    finally:
        g.stop()


def test_startup_warns_when_no_instance_is_reachable():
    dead = [f"http://127.0.0.1:{reserved_port()}" for _ in range(2)]
    g = gateway("--prefill", dead[0], "--decode", dead[1])
    try:
        assert httpx.get(g.url + "/health").status_code == 503
        wait_for(lambda: "none of the 2 configured instances is reachable" in g.log_tail(), what="the warning")
    finally:
        g.stop()
