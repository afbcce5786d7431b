"""Push mode with real processes: parallel P‖D joined by a transfer_id, P writing each layer into D's blocks."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.ids import new_transfer_id
from pdserve.launcher import start, start_instance, stop_all
from server_utils import (CROSS_PROCESS_LOGPROB_TOL, data_planes, metric_values, sse_events, wait_for,
                          wait_until_idle)

ADMIN = {"Authorization": "Bearer push-tests-admin"}
COMMON = ["--max-model-len", "512", "--num-kv-blocks", "192", "--served-model-name", "tiny",
          "--max-num-batched-tokens", "16"]


@pytest.fixture(scope="module", params=data_planes("shm", "tcp", "nixl", "mooncake"))
def cluster(request, models, tmp_path_factory):
    model = models("qwen3")
    plane = request.param
    capture = tmp_path_factory.mktemp("capture")

    def kv(role: str, name: str, **extra) -> str:
        return json.dumps({"kv_connector": "PdConnector", "kv_role": role, "kv_connector_extra_config": {
            "data_plane": plane, "capture_messages": str(capture / f"{name}.jsonl"), **extra}})

    procs = []
    try:
        # P's steps can be slowed at run time (a drill setting) so a test can register while P is partway through
        # a prefill; the others run it at full speed, so 32 queued requests reach P well inside its 2 s lease.
        procs.append(start_instance(model, *COMMON, "--admin-token", ADMIN["Authorization"].split()[1],
                                    "--kv-transfer-config",
                                    kv("kv_producer", "P", kv_lease_duration=2.0, fault_injection_api=True),
                                    name="P"))
        procs.append(start_instance(model, *COMMON, "--kv-transfer-config",
                                    kv("kv_consumer", "D", push_registration_timeout=8.0), name="D"))
        procs.append(start_instance(model, *COMMON, name="C"))
        procs.append(start("gateway", ["gateway", "--prefill", procs[0].url, "--decode", procs[1].url, "--protocol",
                                       "push", "--port", "0", "--log-level", "warning"]))
        yield {"P": procs[0], "D": procs[1], "C": procs[2], "G": procs[3], "capture": capture}
    finally:
        stop_all(procs)


@pytest.fixture(autouse=True)
def ends_clean(cluster):
    yield
    for name in ("P", "D"):
        idle = wait_until_idle(cluster[name].url, timeout=15)
        assert idle["pdserve:kv_transfer_map_size"] == 0, f"{name} left transfer map entries"
        assert idle.get("pdserve:kv_push_expected", 0) == 0


@contextmanager
def slow_steps(cluster, step_delay_s: float):
    """Every step of P takes `step_delay_s` longer until the block ends: a 480-token prefill at 16 tokens a step
    then lasts 30 × that, long enough to be caught running even on a loaded box."""
    url = cluster["P"].url + "/v1/kv/faults"
    assert httpx.post(url, json={"step_delay_s": step_delay_s}, headers=ADMIN, timeout=10).status_code == 200
    try:
        yield
    finally:
        assert httpx.post(url, json={}, headers=ADMIN, timeout=10).status_code == 200


def completion(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny", "temperature": 0, "ignore_eos": True, **body},
                      timeout=60, **kw)


def same_answer(a: dict, b: dict) -> None:
    x, y = a["choices"][0], b["choices"][0]
    assert x["token_ids"] == y["token_ids"]
    diffs = [abs(p - q) for p, q in zip(x["logprobs"]["token_logprobs"], y["logprobs"]["token_logprobs"])]
    assert max(diffs) < CROSS_PROCESS_LOGPROB_TOL


@pytest.mark.core
@pytest.mark.parametrize("length", [1, 7, 32, 100])
def test_push_through_gateway_equals_colocated(cluster, length):
    body = {"prompt": list(range(50, 50 + length)), "max_tokens": 10, "logprobs": 1, "return_token_ids": True}
    done_before = metric_values(cluster["D"].url)["pdserve:kv_push_done_ok_total"]
    r = completion(cluster["G"].url, body)
    assert r.status_code == 200, r.text
    same_answer(r.json(), completion(cluster["C"].url, body).json())
    assert metric_values(cluster["D"].url)["pdserve:kv_push_done_ok_total"] == done_before + 1  # it really pushed


def gateway_outcomes(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.labels["outcome"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "pdserve:gateway_requests_total"}


def test_a_served_push_counts_as_ok_not_cancelled(cluster):
    """The client has its whole answer before P's own reply arrives: that is success, not a client cancel."""
    before = gateway_outcomes(cluster["G"].url)
    for i in range(3):
        assert completion(cluster["G"].url, {"prompt": list(range(60 + i, 90 + i)), "max_tokens": 4}).status_code == 200
    wait_for(lambda: gateway_outcomes(cluster["G"].url).get("ok", 0) == before.get("ok", 0) + 3, what="3 ok outcomes")
    assert gateway_outcomes(cluster["G"].url).get("cancelled", 0) == before.get("cancelled", 0)


def test_a_streamed_answer_read_to_done_counts_as_ok(cluster):
    """A streaming client that hangs up right after [DONE] (as SDKs do) got its whole answer: ok, not cancelled."""
    before = gateway_outcomes(cluster["G"].url)
    n = 12
    for i in range(n):
        body = {"model": "tiny", "prompt": list(range(300 + i, 330 + i)), "max_tokens": 3, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", f"{cluster['G'].url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    break  # leaving the block closes the connection before the body's last chunk is read
    wait_for(lambda: sum(gateway_outcomes(cluster["G"].url).values()) == sum(before.values()) + n,
             what=f"{n} outcomes")
    after = gateway_outcomes(cluster["G"].url)
    assert after.get("cancelled", 0) == before.get("cancelled", 0)
    assert after.get("ok", 0) == before.get("ok", 0) + n


def test_prefix_hits_on_p_and_d(cluster):
    shared = list(range(900, 964))
    for tail in ([1, 2, 3], [4, 5, 6, 7]):
        body = {"prompt": shared + tail, "max_tokens": 6, "logprobs": 1, "return_token_ids": True}
        r = completion(cluster["G"].url, body)
        same_answer(r.json(), completion(cluster["C"].url, body).json())
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # P's hit, reported by the gateway


def push_params(cluster, transfer_id: str) -> dict:
    P = cluster["P"]
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push", "transfer_id": transfer_id,
            "remote_engine_id": P.ready["engine_id"], "remote_host": "127.0.0.1",
            "remote_port": P.ready["side_channel_port"]}


def prefill_leg(cluster, prompt: list[int], transfer_id: str) -> httpx.Response:
    return completion(cluster["P"].url, {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "transfer_mode": "push", "transfer_id": transfer_id}})


def decode_leg(cluster, prompt: list[int], transfer_id: str, **extra) -> httpx.Response:
    return completion(cluster["D"].url, {"prompt": prompt, "max_tokens": 8, "logprobs": 1, "return_token_ids": True,
                                         "kv_transfer_params": push_params(cluster, transfer_id), **extra})


def test_registration_before_prefill_starts(cluster):
    prompt, xfer = list(range(7, 47)), new_transfer_id()
    with ThreadPoolExecutor(1) as pool:
        d = pool.submit(decode_leg, cluster, prompt, xfer)
        wait_for(lambda: metric_values(cluster["D"].url)["pdserve:kv_push_expected"] == 1, what="D to register")
        time.sleep(0.1)  # the registration reaches P before P has the request at all
        assert prefill_leg(cluster, prompt, xfer).status_code == 200
        same_answer(d.result(60).json(), completion(cluster["C"].url, {
            "prompt": prompt, "max_tokens": 8, "logprobs": 1, "return_token_ids": True}).json())


def test_prefix_hit_on_p_only_is_pushed_too(cluster):
    """P serves the first blocks from its prefix cache, so no layer write covers them; D registered beforehand
    and has none of them. They must still reach D intact, not be caught by checksums and recomputed."""
    prompt, xfer = list(range(300, 360)), new_transfer_id()
    assert completion(cluster["P"].url, {"prompt": prompt[:48] + [1], "max_tokens": 1}).status_code == 200
    before = metric_values(cluster["D"].url)
    with ThreadPoolExecutor(1) as pool:
        d = pool.submit(decode_leg, cluster, prompt, xfer)
        wait_for(lambda: metric_values(cluster["D"].url)["pdserve:kv_push_expected"] == 1, what="D to register")
        time.sleep(0.1)
        p = prefill_leg(cluster, prompt, xfer)
        assert p.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        answer = d.result(60).json()
    after = metric_values(cluster["D"].url)
    assert after["pdserve:kv_blocks_invalid_total"] == before["pdserve:kv_blocks_invalid_total"]
    assert after["pdserve:prompt_tokens_computed_total"] - before["pdserve:prompt_tokens_computed_total"] == 1
    same_answer(answer, completion(cluster["C"].url, {
        "prompt": prompt, "max_tokens": 8, "logprobs": 1, "return_token_ids": True}).json())


def test_registration_after_prefill_finished(cluster):
    prompt, xfer = list(range(80, 130)), new_transfer_id()
    p = prefill_leg(cluster, prompt, xfer)
    assert p.status_code == 200 and p.json()["kv_transfer_params"]["transfer_mode"] == "push"
    assert metric_values(cluster["P"].url)["pdserve:kv_blocks_in_use"] > 0  # P holds it for a D to register
    same_answer(decode_leg(cluster, prompt, xfer).json(), completion(cluster["C"].url, {
        "prompt": prompt, "max_tokens": 8, "logprobs": 1, "return_token_ids": True}).json())


def test_registration_during_prefill(cluster):
    """A long chunked prefill on P (16 tokens per step); D registers while P is partway through."""
    prompt, xfer = list(range(1, 481)), new_transfer_id()
    with slow_steps(cluster, 0.05), ThreadPoolExecutor(2) as pool:
        p = pool.submit(prefill_leg, cluster, prompt, xfer)
        wait_for(lambda: metric_values(cluster["P"].url)["vllm:num_requests_running"] == 1, what="P to start")
        d = pool.submit(decode_leg, cluster, prompt, xfer)
        p_done_at = (p.result(60), time.time())[1]
        d_answer = d.result(60).json()
    registered = [json.loads(line) for line in (cluster["capture"] / "P.jsonl").read_text().splitlines()
                  if f'"{xfer}"' in line and '"PushRegister"' in line]
    assert registered and registered[0]["time"] < p_done_at  # it arrived while P was still computing
    same_answer(d_answer, completion(cluster["C"].url, {
        "prompt": prompt, "max_tokens": 8, "logprobs": 1, "return_token_ids": True}).json())


def test_registration_for_a_request_queued_on_p_outlives_p_deadline(cluster):
    """D registers, then P gets the request but queues it behind a long prefill for longer than P's 2 s deadline
    for transfers it has not seen: P knows the request is coming, so the registration waits for it (not "no such
    transfer", which D answers with a 400), and the KV is pushed."""
    prompt, xfer = list(range(600, 640)), new_transfer_id()
    before = metric_values(cluster["D"].url)
    with slow_steps(cluster, 0.1), ThreadPoolExecutor(3) as pool:
        long = pool.submit(completion, cluster["P"].url, {"prompt": list(range(2, 482)), "max_tokens": 1})
        wait_for(lambda: metric_values(cluster["P"].url)["vllm:num_requests_running"] == 1, what="P to start")
        d = pool.submit(decode_leg, cluster, prompt, xfer)
        wait_for(lambda: metric_values(cluster["D"].url)["pdserve:kv_push_expected"] == 1, what="D to register")
        p = pool.submit(prefill_leg, cluster, prompt, xfer)
        wait_for(lambda: metric_values(cluster["P"].url)["vllm:num_requests_waiting"] == 1, what="P to queue it")
        assert long.result(60).status_code == 200 and p.result(60).status_code == 200
        answer = d.result(60)
    assert answer.status_code == 200, answer.text
    after = metric_values(cluster["D"].url)
    assert after["pdserve:kv_push_done_ok_total"] == before["pdserve:kv_push_done_ok_total"] + 1
    same_answer(answer.json(), completion(cluster["C"].url, {
        "prompt": prompt, "max_tokens": 8, "logprobs": 1, "return_token_ids": True}).json())


@pytest.mark.core
def test_32_concurrent_pushes(cluster):
    bodies = [{"prompt": list(range(i * 3, i * 3 + 5 + (i * 11) % 70)), "max_tokens": 6, "logprobs": 1,
               "return_token_ids": True} for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda b: completion(cluster["G"].url, b).json(), bodies))
    for body, answer in zip(bodies, answers):
        same_answer(answer, completion(cluster["C"].url, body).json())


def _post_then_drop(port: int, body: dict, after: callable) -> None:
    payload = json.dumps({"model": "tiny", **body}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    after()
    sock.close()


def test_abort_before_registration_is_answered(cluster):
    """D registered with a P that never got the request: aborting D frees everything at once, not at a timeout."""
    xfer = new_transfer_id()
    started = time.monotonic()
    _post_then_drop(cluster["D"].port, {"prompt": list(range(30)), "max_tokens": 5,
                                        "kv_transfer_params": push_params(cluster, xfer)},
                    lambda: wait_for(lambda: metric_values(cluster["D"].url)["pdserve:kv_push_expected"] == 1))
    wait_until_idle(cluster["D"].url, timeout=5)
    assert time.monotonic() - started < 2.5  # freed on P's answer, long before D's 8 s registration timeout


def _registered_or_ended(url: str, before: dict) -> bool:
    now = metric_values(url)
    return now["pdserve:kv_push_expected"] == 1 or any(
        now[name] > before[name] for name in ("pdserve:kv_push_done_ok_total", "pdserve:kv_push_done_failed_total"))


@pytest.mark.core
def test_abort_during_writes(cluster):
    """D's client leaves while P is still writing: D counts the push failed and releases it, and P frees at once.

    The client leaves as soon as D has registered; on a loaded box P may still finish its writes first, so the
    race is run again (a fresh transfer, a fresh prompt) until the client really left mid-push."""
    for attempt in range(4):
        prompt, xfer = list(range(2 + attempt, 482 + attempt)), new_transfer_id()
        before = metric_values(cluster["D"].url)
        with slow_steps(cluster, 0.02), ThreadPoolExecutor(1) as pool:
            p = pool.submit(prefill_leg, cluster, prompt, xfer)
            # P may finish the whole prefill between two polls of its gauge: then this try registers late and
            # the push completes (caught below as a try that did not race), rather than a wait for what passed.
            wait_for(lambda: p.done() or metric_values(cluster["P"].url)["vllm:num_requests_running"] == 1,
                     what="P to start")
            # D has registered (the gauge), or its push already ended, the whole window between two polls.
            _post_then_drop(cluster["D"].port, {"prompt": prompt, "max_tokens": 5,
                                                "kv_transfer_params": push_params(cluster, xfer)},
                            lambda: wait_for(lambda: _registered_or_ended(cluster["D"].url, before), what="D's push"))
            assert p.result(60).status_code == 200
        after = wait_until_idle(cluster["D"].url, timeout=5)
        wait_until_idle(cluster["P"].url, timeout=5)  # P freed on the release (or the finished push), not a deadline
        if after["pdserve:kv_push_done_ok_total"] == before["pdserve:kv_push_done_ok_total"]:
            assert after["pdserve:kv_push_done_failed_total"] == before["pdserve:kv_push_done_failed_total"] + 1
            return
    pytest.fail("in four tries the client never left before P finished writing")


def test_abort_after_write_done_and_client_disconnect(cluster):
    with httpx.stream("POST", cluster["G"].url + "/v1/completions",
                      json={"model": "tiny", "prompt": list(range(60)), "max_tokens": 300, "ignore_eos": True,
                            "stream": True}, timeout=60) as r:
        next(sse_events(r))  # tokens are flowing: the push is done; leave now


def test_unregistered_prefill_is_dropped_by_its_deadline(cluster):
    before = metric_values(cluster["P"].url)["pdserve:kv_push_unregistered_expired_total"]
    assert prefill_leg(cluster, list(range(40)), new_transfer_id()).status_code == 200
    wait_until_idle(cluster["P"].url, timeout=10)
    assert metric_values(cluster["P"].url)["pdserve:kv_push_unregistered_expired_total"] == before + 1


def test_registration_after_p_freed_the_transfer_recomputes(cluster):
    """A registration that arrives after P's deadline freed an unregistered transfer (say it was delayed) is told
    "expired", not "denied": D computes the prompt itself and the client gets the colocated answer."""
    prompt, xfer = list(range(500, 540)), new_transfer_id()
    before = metric_values(cluster["P"].url)["pdserve:kv_push_unregistered_expired_total"]
    assert prefill_leg(cluster, prompt, xfer).status_code == 200
    wait_for(lambda: metric_values(cluster["P"].url)["pdserve:kv_push_unregistered_expired_total"] == before + 1,
             what="P to free the unregistered transfer")
    body = {"prompt": prompt, "max_tokens": 8, "logprobs": 1, "return_token_ids": True}
    d = decode_leg(cluster, prompt, xfer)
    assert d.status_code == 200, d.text
    same_answer(d.json(), completion(cluster["C"].url, body).json())
    wait_until_idle(cluster["P"].url, timeout=10)
    wait_until_idle(cluster["D"].url, timeout=10)


def test_internal_ids_never_cross_instances(cluster):
    prompt, xfer = list(range(100, 140)), new_transfer_id()
    p = prefill_leg(cluster, prompt, xfer)
    d = decode_leg(cluster, prompt, xfer)
    p_id, d_id = p.headers["x-pdserve-request-ids"], d.headers["x-pdserve-request-ids"]
    assert p_id != d_id
    traffic = "".join(f.read_text() for f in cluster["capture"].glob("*.jsonl"))
    assert xfer in traffic  # the capture saw this transfer...
    assert p_id not in traffic and d_id not in traffic  # ...and no internal request id
