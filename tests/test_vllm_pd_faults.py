"""PdConnector inside vLLM over the shm data plane, a producer killed mid-transfer, and pdserve's transfer
metrics on vLLM's /metrics.

What must hold: two vLLM instances on one host pull over shm (D is configured for shm alone, so a load that
did not go over shm fails and shows: nothing external is counted) and the answer equals the same vLLM
colocated; pdserve's transfer counters and gauges appear on both instances' /metrics and move as the transfer
did (D's loads and bytes, P's read-done, P's held leases back to zero). Then P is SIGKILLed after it granted a
read and before D copies (D's reads are slowed by fault injection, so the kill lands inside the transfer): D's
load fails, vLLM's recompute policy computes the prompt on D and the answer is still colocated vLLM's; D serves
the next request; D's cache is idle again, its failed-load counter counts the failure and its held-transfer
gauges are zero.

Two vLLM instances for the module (P also serves as the colocated oracle); the kill is the last test.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import random_prompt
from pdserve.kv_transfer.metrics import TRANSFER_METRICS
from server_utils import assert_same_answer, metric_values, wait_for
from test_vllm_pd_connector import complete, external_tokens, prefill_held
from vllm_live import pd_connector_pull, usage

pytestmark = pytest.mark.vllm

# D stalls this long between P's grant and its copy: the window in which the test kills P.
READ_DELAY_S = 4.0
HELD_GAUGES = ("pdserve:kv_leases_held", "pdserve:kv_transfer_map_size", "pdserve:kv_push_expected")


@pytest.fixture(scope="module")
def pair(models, tmp_path_factory):
    capture = tmp_path_factory.mktemp("capture") / "d.msgs"
    consumer = {"data_plane": "shm", "capture_messages": str(capture),
                "fault_injection": {"read_delay_s": READ_DELAY_S}}
    with pd_connector_pull(models("llama"), {}, consumer) as (p, d, gateway):
        yield {"P": p.url, "D": d.url, "gateway": gateway.url, "capture": capture, "P_process": p, "D_process": d}


def metric(url: str, name: str) -> float:
    return metric_values(url).get(name, 0.0)


def grants_received(capture) -> int:
    """Read grants D has been answered so far (from its side-channel capture)."""
    if not capture.exists():
        return 0
    # Only whole lines: the connector may be writing the last one while it is read.
    lines = capture.read_text(errors="replace").split("\n")[:-1]
    return sum(1 for line in lines if json.loads(line)["type"] == "ReadGrantReply")


def test_transfer_metrics_are_on_both_vllm_instances_metrics(pair):
    for url in (pair["P"], pair["D"]):
        names = set(metric_values(url))
        expected = {m.name + ("_total" if m.kind == "counter" else "") for m in TRANSFER_METRICS}
        assert expected <= names, sorted(expected - names)


def test_pull_over_shm_between_two_vllm_instances_equals_colocated(pair):
    prompt = random_prompt(300, 61)  # three vLLM blocks
    expected = complete(pair["P"], prompt).json()
    before = {"external": external_tokens(pair["D"]), "ok": metric(pair["D"], "pdserve:kv_transfer_loads_ok_total"),
              "bytes": metric(pair["D"], "pdserve:kv_transfer_bytes_received_total"),
              "done": metric(pair["P"], "pdserve:kv_read_done_received_total")}
    response = complete(pair["gateway"], prompt)
    assert response.status_code == 200, response.text
    assert_same_answer(response.json(), expected)
    assert external_tokens(pair["D"]) - before["external"] >= len(prompt) - 1  # loaded over shm, not computed
    wait_for(lambda: metric(pair["D"], "pdserve:kv_transfer_loads_ok_total") == before["ok"] + 1, timeout=20,
             what="D's loads counter on its /metrics")
    assert metric(pair["D"], "pdserve:kv_transfer_bytes_received_total") > before["bytes"]
    assert metric(pair["D"], "pdserve:kv_transfer_loads_failed_total") == 0
    wait_for(lambda: metric(pair["P"], "pdserve:kv_read_done_received_total") == before["done"] + 1, timeout=20,
             what="P's read-done counter on its /metrics")
    wait_for(lambda: metric(pair["P"], "pdserve:kv_leases_held") == 0, timeout=20, what="P's held leases at zero")
    wait_for(lambda: usage(pair["P"]) == 0.0, timeout=20, what="vLLM P's KV cache to be idle")
    wait_for(lambda: usage(pair["D"]) == 0.0, timeout=20, what="vLLM D's KV cache to be idle")


def test_prefill_killed_mid_transfer_means_decode_recomputes_and_goes_on(pair):
    """Last in the module: it kills P."""
    prompt, after = random_prompt(200, 62), random_prompt(60, 63)
    expected = complete(pair["P"], prompt).json()
    expected_after = complete(pair["P"], after).json()
    held = prefill_held(pair["P"], prompt, "crash-mid-read")
    grants = grants_received(pair["capture"])
    before = {"external": external_tokens(pair["D"]),
              "failed": metric(pair["D"], "pdserve:kv_transfer_loads_failed_total")}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(complete, pair["D"], prompt, kv_transfer_params=held)
        wait_for(lambda: grants_received(pair["capture"]) > grants, timeout=60, what="P to grant D's read")
        assert not answer.done()  # D is inside the transfer: granted, not yet copied
        pair["P_process"].crash()
        response = answer.result(timeout=120)
    assert response.status_code == 200, response.text
    assert_same_answer(response.json(), expected)  # recomputed on D
    assert external_tokens(pair["D"]) == before["external"]  # nothing was loaded
    assert "its process is gone" in pair["D_process"].log_tail(20000)  # the shm copy itself failed
    response = complete(pair["D"], after)
    assert response.status_code == 200, response.text
    assert_same_answer(response.json(), expected_after)
    wait_for(lambda: metric(pair["D"], "pdserve:kv_transfer_loads_failed_total") == before["failed"] + 1,
             timeout=20, what="D's failed-load counter on its /metrics")
    wait_for(lambda: usage(pair["D"]) == 0.0, timeout=20, what="vLLM D's KV cache to be idle")
    values = metric_values(pair["D"])
    assert all(values[name] == 0 for name in HELD_GAUGES), {name: values[name] for name in HELD_GAUGES}
