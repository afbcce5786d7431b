"""The gateway with real pdserve instances (and recording fakes of vLLM where vLLM cannot run here)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.gateway.policies import LeastLoaded, PrefixAware
from pdserve.gateway.registry import Instance
from pdserve.launcher import LaunchError, start, start_command, start_instance, stop_all
from server_utils import metric_values, sse_events, wait_for, wait_until_idle

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "192", "--served-model-name", "tiny"]
SUPPORTED = [("pull", "batch"), ("pull", "staged"), ("decode-first", "batch"), ("push", "batch")]


def kv(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role, "kv_connector_extra_config": extra})


@pytest.fixture(scope="module")
def cluster(models):
    model = models("qwen2")
    procs = []
    try:
        for name, role in (("P1", "kv_producer"), ("P2", "kv_producer"), ("D1", "kv_consumer"), ("D2", "kv_consumer")):
            procs.append(start_instance(model, *COMMON, "--kv-transfer-config", kv(role), name=name))
        procs.append(start_instance(model, *COMMON, name="C"))
        yield {p.name: p for p in procs}
    finally:
        stop_all(procs)


def gateway(*args: str) -> object:
    return start("gateway", ["gateway", "--port", "0", "--log-level", "warning", *args])


def idle_everywhere(cluster: dict, names=("P1", "P2", "D1", "D2")) -> None:
    for name in names:
        wait_until_idle(cluster[name].url)
        assert metric_values(cluster[name].url).get("pdserve:kv_leases_held", 0) == 0


REQUESTS = [
    ("/v1/completions", {"prompt": "the gateway keeps every leg honest", "max_tokens": 12}),
    ("/v1/completions", {"prompt": list(range(40, 110)), "max_tokens": 8, "min_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "why disaggregate?"}], "max_tokens": 10}),
]


def reference(cluster: dict, path: str, body: dict) -> str:
    data = httpx.post(cluster["C"].url + path, json={**body, "model": "tiny", "temperature": 0, "ignore_eos": True},
                      timeout=60).json()
    choice = data["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def via_gateway(url: str, path: str, body: dict, stream: bool) -> str:
    full = {**body, "model": "tiny", "temperature": 0, "ignore_eos": True}
    if not stream:
        r = httpx.post(url + path, json=full, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    with httpx.stream("POST", url + path, json={**full, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        pieces = []
        for event in sse_events(r):
            if "error" in event:  # after the first byte an error can only arrive as an event
                assert event["error"]["message"] and event["error"]["code"] >= 400
                raise AssertionError(f"stream ended with an error event: {event['error']['message']}")
            for c in event["choices"]:
                pieces.append(c.get("text") or c.get("delta", {}).get("content") or "")
        return "".join(pieces)


def moved(url: str) -> float:
    """Transfers that completed on a decode instance: pulled loads plus pushes received."""
    m = metric_values(url)
    return m["pdserve:kv_transfer_loads_ok_total"] + m["pdserve:kv_push_done_ok_total"]


@pytest.mark.parametrize("topology", ["1P1D", "2P2D"])
@pytest.mark.parametrize("protocol,scheduling", SUPPORTED)
def test_protocols_equal_colocated(cluster, topology, protocol, scheduling):
    ps = ["P1"] if topology == "1P1D" else ["P1", "P2"]
    ds = ["D1"] if topology == "1P1D" else ["D1", "D2"]
    g = gateway("--prefill", *[cluster[p].url for p in ps], "--decode", *[cluster[d].url for d in ds],
                "--protocol", protocol, "--scheduling", scheduling, "--policy", "round_robin")
    try:
        loads_before = sum(moved(cluster[d].url) for d in ds)
        for path, body in REQUESTS * (2 if topology == "2P2D" else 1):
            expected = reference(cluster, path, body)
            for stream in (False, True):
                assert via_gateway(g.url, path, body, stream) == expected
        loads = sum(moved(cluster[d].url) for d in ds) - loads_before
        assert loads == len(REQUESTS) * 2 * (2 if topology == "2P2D" else 1)  # every request really moved KV
        if topology == "2P2D":  # both pairs served
            assert all(moved(cluster[d].url) > 0 for d in ds)
    finally:
        g.stop()
    idle_everywhere(cluster)


@pytest.mark.parametrize("scheduling", ["batch", "staged"])
def test_colocated_protocol(cluster, scheduling):
    g = gateway("--both", cluster["C"].url, "--protocol", "colocated", "--scheduling", scheduling)
    try:
        for path, body in REQUESTS:
            assert via_gateway(g.url, path, body, stream=True) == reference(cluster, path, body)
    finally:
        g.stop()


def test_usage_merges_prefill_and_decode(cluster):
    g = gateway("--prefill", cluster["P1"].url, "--decode", cluster["D1"].url)
    try:
        prompt = list(range(300, 340))
        httpx.post(g.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
        r = httpx.post(g.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "ignore_eos": True},
                       timeout=60).json()
        assert r["usage"]["prompt_tokens"] == 40 and r["usage"]["completion_tokens"] == 5
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # P's prefix hit, not D's
    finally:
        g.stop()
    idle_everywhere(cluster)


def test_bad_protocol_or_mode_fails_at_startup():
    for args, expected in ((["--protocol", "carrier-pigeon"], "supported: "),
                           (["--protocol", "decode-first", "--scheduling", "staged"], "it supports: batch"),
                           (["--rebalance", "--rebalance-max-mib-per-s", "-1"], "rebalance_max_mib_per_s must be")):
        done = subprocess.run([sys.executable, "-m", "pdserve", "gateway", "--port", "0", *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        assert expected in done.stderr and "pull" in done.stderr + " pull"


def test_register_deregister_and_readiness(cluster):
    g = gateway("--protocol", "pull", "--admin-token", "t0ken")
    admin = {"Authorization": "Bearer t0ken"}
    try:
        assert httpx.get(g.url + "/health").status_code == 503  # no pair yet
        r = httpx.post(g.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        registered = httpx.post(g.url + "/register", json={"url": cluster["P1"].url, "role": "prefill"},
                                headers=admin).json()
        assert registered["kind"].startswith("pdserve ") and "PdConnector" in registered["kind"]  # learned at once
        assert httpx.get(g.url + "/health").status_code == 503  # still no decode instance
        httpx.post(g.url + "/register", json={"url": cluster["D1"].url, "role": "decode"}, headers=admin)
        assert httpx.get(g.url + "/health").status_code == 200
        assert via_gateway(g.url, *REQUESTS[0], stream=False) == reference(cluster, *REQUESTS[0])
        httpx.post(g.url + "/deregister", json={"url": cluster["D1"].url}, headers=admin)
        assert httpx.get(g.url + "/health").status_code == 503
        assert httpx.post(g.url + "/register", json={"url": "not a url"}, headers=admin).status_code == 400
    finally:
        g.stop()


@pytest.mark.parametrize("protocol", ["pull", "push", "decode-first"])
def test_a_long_request_id_is_cut_and_the_request_served(cluster, protocol):
    """An X-Request-Id far past what pdserve carries is cut (the answer's header says to what) and the request is
    served as colocated serves it: P's own id, built from it and longer, still reaches D (pull, decode-first)."""
    g = gateway("--prefill", cluster["P1"].url, "--decode", cluster["D1"].url, "--protocol", protocol)
    try:
        path, body = REQUESTS[0]
        full = {**body, "model": "tiny", "temperature": 0, "ignore_eos": True}
        r = httpx.post(g.url + path, json=full, headers={"X-Request-Id": "r" * 8000}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference(cluster, path, body)
        used = r.headers["x-request-id"]
        assert used == "r" * 256
        for url in (g.url, cluster["P1"].url, cluster["D1"].url):  # the timeline is found under the id used
            timeline = httpx.get(f"{url}/v1/timeline/{used}", timeout=10)
            assert timeline.status_code == 200, (url, timeline.text)
    finally:
        g.stop()
    idle_everywhere(cluster, ("P1", "D1"))


def test_a_long_prompt_list_answers_with_headers_a_client_reads(cluster):
    """5,000 prompts in one completion: the instance lists its internal ids in a header only as far as a few KB
    allow (the rest are counted, and all of them are in the timeline), so a stock httpx client (16 KiB for the
    whole head) reads the answer, directly and through a gateway."""
    prompts = [[7, 8 + i % 50] for i in range(5000)]
    g = gateway("--both", cluster["C"].url, "--protocol", "colocated")
    try:
        for name, url in (("instance", cluster["C"].url), ("gateway", g.url)):
            r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 1},
                           headers={"X-Request-Id": f"list-{name}"}, timeout=300)
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 5000
            assert max(len(v) for v in r.headers.values()) <= 4096, {k: len(v) for k, v in r.headers.items()}
            if name == "instance":
                listed = r.headers["x-pdserve-request-ids"].split(",")
                omitted = int(r.headers["x-pdserve-request-ids-omitted"])
        timelines = httpx.get(cluster["C"].url + "/v1/timeline/list-instance", timeout=30).json()["data"]
        internal = [t["internal_request_id"] for t in timelines]
        assert len(internal) == 5000 and len(listed) + omitted == 5000 and listed == internal[:len(listed)]
    finally:
        g.stop()


def test_kv_params_an_instance_refuses_never_reach_the_client(recorded):
    """D refuses the KV parameters P handed out (a 400 naming kv_transfer_params, which the client never sent):
    the client gets D's own answer, computed without them, and the gateway counts why."""
    start_fake, received = recorded
    p, d = start_fake("P"), start_fake("D", "--refuse-kv-params")
    g = gateway("--prefill", p.url, "--decode", d.url, "--retries", "0")
    try:
        r = httpx.post(g.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == " a b c"
        first, second = received("D")
        assert first["body"]["kv_transfer_params"]["do_remote_prefill"] is True
        assert "kv_transfer_params" not in second["body"]
        text = httpx.get(g.url + "/metrics", timeout=10).text
        assert [s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "pdserve:gateway_disagg_decisions_total"
                and s.labels == {"decision": "local_prefill", "reason": "decode_refused_kv_params"}] == [1.0]
    finally:
        g.stop()


def test_a_request_an_instance_refuses_leaves_every_other_client_served(cluster):
    """Bodies P answers with an error (whatever it is: compared with P's own direct answer) reach that client with
    P's status and message, while the clients around it are served as usual: no instance is taken away."""
    g = gateway("--prefill", cluster["P1"].url, "--decode", cluster["D1"].url)
    try:
        for bad in ({"prompt": []}, {"prompt": "x", "max_tokens": 100000}, {"prompt": [10 ** 9]}):
            direct = httpx.post(cluster["P1"].url + "/v1/completions", json=bad, timeout=60)
            assert direct.status_code >= 400
            for _ in range(3):
                r = httpx.post(g.url + "/v1/completions", json=bad, timeout=60)
                assert (r.status_code, r.json()["error"]["message"]) == (
                    direct.status_code, direct.json()["error"]["message"])
                assert via_gateway(g.url, *REQUESTS[0], stream=False) == reference(cluster, *REQUESTS[0])
        assert 'to="open"' not in httpx.get(g.url + "/metrics").text
    finally:
        g.stop()
    idle_everywhere(cluster, ("P1", "D1"))


def test_client_disconnect_mid_stream_frees_everything(cluster):
    g = gateway("--prefill", cluster["P1"].url, "--decode", cluster["D1"].url)
    try:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", g.url + "/v1/completions",
                               json={"prompt": list(range(60)), "max_tokens": 400, "ignore_eos": True,
                                     "stream": True}) as r:
                next(r.iter_lines())  # the stream has begun; now walk away
        idle_everywhere(cluster, ("P1", "D1"))
        text = httpx.get(g.url + "/metrics").text
        assert 'pdserve:gateway_cancellations_total{stage="streaming"} 1.0' in text
    finally:
        g.stop()


def test_sigkill_under_load(models, cluster):
    """Kill a P and a D while 16 requests run: each ends correct or with a clear error; survivors end empty."""
    model = models("qwen2")
    victims = [start_instance(model, *COMMON, "--kv-transfer-config", kv("kv_producer"), name="P-victim"),
               start_instance(model, *COMMON, "--kv-transfer-config", kv("kv_consumer"), name="D-victim")]
    g = gateway("--prefill", cluster["P1"].url, victims[0].url, "--decode", cluster["D1"].url, victims[1].url,
                "--policy", "round_robin", "--retries", "2")
    body = ("/v1/completions", {"prompt": "survive the crash", "max_tokens": 40})
    expected = reference(cluster, *body)

    def one(i: int):
        try:
            return via_gateway(g.url, *body, stream=i % 2 == 0)
        except AssertionError as exc:  # a non-200 answer: it must be a well-formed error
            return exc

    try:
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(one, i) for i in range(16)]
            time.sleep(0.3)
            for victim in victims:
                victim.kill()
            results = [f.result(timeout=120) for f in futures]
        ok = [r for r in results if r == expected]
        errors = [r for r in results if isinstance(r, AssertionError)]
        assert len(ok) + len(errors) == 16  # nothing wrong, nothing hung
        assert httpx.get(g.url + "/health").status_code == 200  # the gateway stayed up, survivors serve
        assert via_gateway(g.url, *body, stream=False) == expected
    finally:
        g.stop()
        stop_all(victims)
    idle_everywhere(cluster, ("P1", "D1"))


def test_pull_speaks_vllm_wire_format(recorded):
    """Against fake vLLM instances: the legs carry what vLLM's own toy proxy sends (a prefill leg with
    max_tokens 1 and do_remote_decode, then the decode leg with P's kv_transfer_params)."""
    start_fake, received = recorded
    p, d = start_fake("P"), start_fake("D")
    g = gateway("--prefill", p.url, "--decode", d.url)
    try:
        client_body = {"model": "m", "prompt": "Hello world", "max_tokens": 4, "temperature": 0, "min_tokens": 2,
                       "stream": True, "stream_options": {"include_usage": True}, "my_custom_field": "keep-me",
                       "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "evil"}}
        with httpx.stream("POST", g.url + "/v1/completions", json=client_body, headers={"X-Request-Id": "rid-7"},
                          timeout=30) as r:
            events = list(sse_events(r))
        assert r.headers["x-request-id"] == "rid-7"
        (p_req,), (d_req,) = received("P"), received("D")
        pb, db = p_req["body"], d_req["body"]
        assert pb["max_tokens"] == 1 and pb["stream"] is False
        assert "min_tokens" not in pb and "stream_options" not in pb and pb["my_custom_field"] == "keep-me"
        assert pb["kv_transfer_params"]["do_remote_decode"] is True
        assert pb["kv_transfer_params"]["transfer_id"].startswith("xfer-")
        p_answer_params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
                           "remote_engine_id": "fake-engine", "remote_host": "127.0.0.1", "remote_port": 5600,
                           "tp_size": 1}
        assert {k: v for k, v in db["kv_transfer_params"].items() if k != "remote_request_id"} == p_answer_params
        assert {k: v for k, v in db.items() if k != "kv_transfer_params"} == {
            k: v for k, v in client_body.items() if k != "kv_transfer_params"}  # the original body, untouched
        assert p_req["headers"]["x-request-id"] == d_req["headers"]["x-request-id"] == "rid-7"
        # Usage: prompt and cached tokens from P, completion tokens from D.
        assert events[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                       "prompt_tokens_details": {"cached_tokens": 3}}
    finally:
        g.stop()


def test_decode_failure_releases_prefill_kv_and_retries_fresh(cluster, recorded):
    """D refuses (503) after P has prefilled: P's KV is freed at once by message; retries get a new transfer_id."""
    start_fake, received = recorded
    bad_d = start_fake("D", "--fail-status", "503", "--kind", "pdserve")
    g = gateway("--prefill", cluster["P1"].url, "--decode", bad_d.url, "--retries", "1")
    try:
        before = metric_values(cluster["P1"].url)
        r = httpx.post(g.url + "/v1/completions", json={"prompt": list(range(50)), "max_tokens": 5}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["message"]
        after = wait_until_idle(cluster["P1"].url, timeout=5)  # far sooner than the 30 s lease
        assert after["pdserve:kv_releases_received_total"] - before["pdserve:kv_releases_received_total"] == 2
        assert after["pdserve:kv_lease_expired_requests_total"] == before["pdserve:kv_lease_expired_requests_total"]
        transfer_ids = {req["body"]["kv_transfer_params"].get("transfer_id") for req in received("D")}
        assert len(received("D")) == 2 and len(transfer_ids) == 2  # one retry, each attempt its own transfer_id
    finally:
        g.stop()


def test_a_decode_that_dies_after_admitting_a_stream_leaves_nothing_held(cluster, recorded):
    """D answered 200 for a stream (so it admitted the request) and died before its first token, i.e. while it
    still loads P's KV: P's KV is freed by the gateway's release, not left to the 30 s lease."""
    start_fake, _ = recorded
    dying_d = start_fake("D", "--die-after-headers", "--kind", "pdserve")
    g = gateway("--prefill", cluster["P1"].url, "--decode", dying_d.url, "--retries", "0")
    try:
        before = metric_values(cluster["P1"].url)
        with httpx.stream("POST", g.url + "/v1/completions", timeout=30,
                          json={"prompt": list(range(40)), "max_tokens": 5, "stream": True}) as r:
            text = "".join(r.iter_text())
        assert "error" in text  # the client hears of it, in the stream or as the answer
        after = wait_until_idle(cluster["P1"].url, timeout=5)  # far sooner than the 30 s lease
        assert after["pdserve:kv_releases_received_total"] - before["pdserve:kv_releases_received_total"] == 1
    finally:
        g.stop()


def gateway_samples(g) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(httpx.get(g.url + "/metrics").text) for s in f.samples}


def test_a_release_of_kv_no_longer_held_is_not_counted_as_made(models, recorded):
    """D fails only after P's lease ran out: P answers the gateway's release with released=false, which the
    gateway counts as not made (nothing_held), not as a free it made."""
    start_fake, _ = recorded
    p = start_instance(models("qwen2"), *COMMON, "--kv-transfer-config",
                       kv("kv_producer", kv_lease_duration=0.5), name="P-short-lease")
    slow_bad_d = start_fake("D", "--fail-status", "503", "--fail-delay", "2.5", "--kind", "pdserve")
    g = gateway("--prefill", p.url, "--decode", slow_bad_d.url, "--retries", "0")
    try:
        r = httpx.post(g.url + "/v1/completions", json={"prompt": list(range(30)), "max_tokens": 3}, timeout=30)
        assert r.status_code == 503
        wait_until_idle(p.url, timeout=5)
        not_made = ("pdserve:gateway_kv_releases_not_made_total",
                    (("not_made", "nothing_held"), ("reason", "decode_not_admitted")))
        wait_for(lambda: not_made in gateway_samples(g), timeout=10, what="the release answered")
        samples = gateway_samples(g)
        assert samples.get(("pdserve:gateway_kv_releases_total", (("reason", "decode_not_admitted"),)), 0) == 0
        assert samples[not_made] == 1
        assert metric_values(p.url)["pdserve:kv_lease_expired_requests_total"] == 1
    finally:
        stop_all([g, p])


def test_no_release_is_sent_to_vllm_nor_counted(recorded):
    """vLLM has no endpoint to free held KV (its lease frees it): when D refuses, the gateway sends vLLM P no
    release, counts none as made, counts each as not made with the reason, and says so once per instance."""
    start_fake, received = recorded
    p, bad_d = start_fake("P"), start_fake("D", "--fail-status", "503")
    g = gateway("--prefill", p.url, "--decode", bad_d.url, "--retries", "1")
    try:
        r = httpx.post(g.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 503
        samples = gateway_samples(g)
        assert samples.get(("pdserve:gateway_kv_releases_total", (("reason", "decode_not_admitted"),)), 0) == 0
        assert samples[("pdserve:gateway_kv_releases_not_made_total",
                        (("not_made", "no_release_endpoint"), ("reason", "decode_not_admitted")))] == 2
        assert g.log_tail(100_000).count("has no endpoint to free held KV") == 1  # once per instance
    finally:
        g.stop()  # waits for releases still in flight
    assert [req["path"] for req in received("P")] == ["/v1/completions"] * 2  # two attempts, no release tried


def test_pairs_only_instances_whose_connectors_talk(recorded):
    """Fakes that describe themselves as vLLM (NixlConnector) or pdserve: round robin walks both lists by index,
    which would cross them on every request; the gateway pairs like with like, and a pool that cannot serve push
    at all is refused at startup."""
    start_fake, received = recorded
    fakes = {name: start_fake(name, "--kind", kind).url
             for name, kind in (("vP", "vllm"), ("pP", "pdserve"), ("pD", "pdserve"), ("vD", "vllm"))}
    g = gateway("--prefill", fakes["vP"], fakes["pP"], "--decode", fakes["pD"], fakes["vD"], "--policy", "round_robin")
    try:
        for i in range(4):
            r = httpx.post(g.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3},
                           headers={"X-Request-Id": f"r{i}"}, timeout=30)
            assert r.status_code == 200, r.text
    finally:
        g.stop()
    ids = {name: {req["headers"]["x-request-id"] for req in received(name)} for name in fakes}
    assert ids["vP"] == ids["vD"] and ids["pP"] == ids["pD"] and len(ids["vP"]) == len(ids["pP"]) == 2
    with pytest.raises(LaunchError) as startup:
        gateway("--prefill", fakes["vP"], "--decode", fakes["vD"], "--protocol", "push")
    assert "can serve the push protocol" in str(startup.value) and "pull only" in str(startup.value)


def test_prefill_deadline_gives_504_not_a_hang(recorded):
    start_fake, _ = recorded
    p, d = start_fake("P", "--hang"), start_fake("D")
    g = gateway("--prefill", p.url, "--decode", d.url, "--prefill-timeout", "1", "--retries", "0")
    try:
        started = time.monotonic()
        r = httpx.post(g.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 504 and "took longer than" in r.json()["error"]["message"]
        assert time.monotonic() - started < 10
    finally:
        g.stop()


def test_a_prefill_answer_that_is_no_completion_is_a_502_not_a_crash(recorded):
    start_fake, received = recorded
    p, d = start_fake("P", "--prefill-answers-a-list"), start_fake("D")
    g = gateway("--prefill", p.url, "--decode", d.url, "--retries", "0")
    try:
        r = httpx.post(g.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 502 and "answered invalid JSON" in r.json()["error"]["message"], r.text
        assert received("D") == []  # nothing was sent on to D with parameters the gateway could not read
    finally:
        g.stop()


def test_conditional_disaggregation(cluster):
    g = gateway("--prefill", cluster["P1"].url, "--decode", cluster["D1"].url, "--conditional",
                "--min-prompt-tokens", "32")
    try:
        p_prompt_tokens = metric_values(cluster["P1"].url)["vllm:prompt_tokens_total"]
        short = {"prompt": list(range(10)), "max_tokens": 3}
        assert via_gateway(g.url, "/v1/completions", short, False) == reference(cluster, "/v1/completions", short)
        assert metric_values(cluster["P1"].url)["vllm:prompt_tokens_total"] == p_prompt_tokens  # P untouched
        long = {"prompt": list(range(500, 600)), "max_tokens": 3}
        assert via_gateway(g.url, "/v1/completions", long, False) == reference(cluster, "/v1/completions", long)
        assert via_gateway(g.url, "/v1/completions", long, False) == reference(cluster, "/v1/completions", long)
        text = httpx.get(g.url + "/metrics").text
        assert 'decision="local_prefill",reason="short_prompt"} 1.0' in text
        assert 'decision="remote_prefill",reason="long_prompt"} 1.0' in text
        assert 'decision="local_prefill",reason="decode_holds_prefix"} 1.0' in text
        for leg in ("prefill", "kv_ready", "decode_first_token", "e2e"):
            assert f'pdserve:gateway_leg_seconds_count{{leg="{leg}"}}' in text
    finally:
        g.stop()
    idle_everywhere(cluster, ("P1", "D1"))


def _instance(url: str, **load) -> Instance:
    instance = Instance(url=url, role="decode", pool=None, probe_pool=None, **load)
    instance.breaker.probe_result(ok=True, slow=False)
    return instance


def test_least_loaded_prefers_the_idle_instance():
    busy, idle = _instance("http://a:1", running=5), _instance("http://b:1", in_flight=1)
    assert LeastLoaded().pick([busy, idle]) is idle
    idle.in_flight = 9  # the gateway's own count wins when the scrape is stale
    assert LeastLoaded().pick([busy, idle]) is busy


def test_prefix_aware_is_sticky_until_imbalanced():
    a, b = _instance("http://a:1"), _instance("http://b:1")
    policy = PrefixAware(balance_threshold=3)
    first = policy.pick([a, b], b"same prefix")
    assert all(policy.pick([a, b], b"same prefix") is first for _ in range(5))
    first.in_flight = 10
    assert policy.pick([a, b], b"same prefix") is not first


def test_load_is_scraped_only_where_it_decides_something(recorded):
    """Two P: least_loaded picks between them by their scraped load. One D: nothing to pick, so it is not polled."""
    start_fake, _ = recorded
    fakes = {name: start_fake(name) for name in ("P1", "P2", "D")}
    g = gateway("--prefill", fakes["P1"].url, fakes["P2"].url, "--decode", fakes["D"].url)
    try:
        def scrapes(name: str) -> float:
            return metric_values(fakes[name].url)["fake:metrics_scrapes_total"]

        def wait_for_p1(count: float) -> None:
            deadline = time.monotonic() + 30
            while scrapes("P1") < count and time.monotonic() < deadline:
                time.sleep(0.2)

        wait_for_p1(6)
        seen = scrapes("D")  # learning what D is may read its /metrics once (vLLM's connector shows there)
        wait_for_p1(scrapes("P1") + 6)
        assert scrapes("P2") >= 6
        assert scrapes("D") == seen + 1  # only this read since: D's load is never polled
    finally:
        g.stop()


def test_load_is_not_scraped_for_a_policy_that_does_not_read_it(recorded):
    """round_robin never reads load: beyond learning what each instance is, nothing polls their /metrics."""
    start_fake, _ = recorded
    fakes = {name: start_fake(name) for name in ("P1", "P2", "D")}
    g = gateway("--prefill", fakes["P1"].url, fakes["P2"].url, "--decode", fakes["D"].url, "--policy", "round_robin")
    try:
        def scrapes() -> dict[str, float]:
            return {name: metric_values(fake.url)["fake:metrics_scrapes_total"] for name, fake in fakes.items()}

        wait_for(lambda: httpx.get(g.url + "/health", timeout=5).status_code == 200, what="the gateway ready")
        seen = scrapes()
        time.sleep(1.5)  # least_loaded would have polled each P 7 times by now (every 0.2 s)
        assert scrapes() == {name: count + 1 for name, count in seen.items()}  # only the reads just above
    finally:
        g.stop()
