"""Migration under faults: nothing a client was sent is lost or repeated, and nothing stays held anywhere.

* the copy fails (damaged blocks) or the target dies before the handover: the request goes on at its source;
* the source dies during the copy: the gateway goes on elsewhere, recomputing from the prompt and the tokens its
  client has; the source dies after the handover: the target has everything;
* the client leaves during the copy: the migration is abandoned at once on both instances (long before any lease
  or deadline would free it: leases here last 60 s).

Every answer equals the same request unmoved. Faults are the instances' own fault injection (slow or damaged
reads, slow steps) and real SIGKILLs.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest

from migration_fleet import Fleet, Stream, blocks_in_use, kv_config
from test_migration import assert_same, body, other, unmoved
from server_utils import wait_for

LEASE_S = 60.0


@pytest.fixture(scope="module")
def fleet(models):
    config = ["--kv-transfer-config", kv_config("kv_consumer", lease_s=LEASE_S)]
    f = Fleet(models("llama"), {"D1": config, "D2": config})
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture(autouse=True)
def _whole_fleet_after(fleet):
    """A test that failed half way must not leave the next one a dead or slowed instance: each decode instance
    killed is started again and every fault cleared (the tests that pass do it themselves)."""
    yield
    for name in ("D1", "D2"):
        if not fleet.procs[name].alive():
            fleet.restart(name)
        fleet.faults(name)


def start_moving(fleet: Fleet, request: dict, after: int = 15):
    """Stream `request` and ask for it to move (in the background): (stream, source, target, the move's answer)."""
    stream = Stream(fleet, request)
    stream.wait_for_events(after)
    source = fleet.serving(stream.request_id)
    target = other(fleet, source)
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(r=fleet.migrate(stream.request_id, target)))
    thread.start()
    return stream, source, target, (thread, answer)


def reserving(fleet: Fleet, name: str) -> None:
    """The target reserved blocks for the copy (and is reading into them, slowly)."""
    wait_for(lambda: blocks_in_use(fleet[name]) > 0, 30, f"{name} to reserve blocks for the copy")


def outcome(move) -> dict:
    thread, answer = move
    thread.join(120)
    r = answer["r"]
    assert r.status_code in (200, 502), r.text
    return r.json()["data"][0] if r.status_code == 200 else {"outcome": "failed", "error": r.text}


def test_damaged_copy_leaves_the_request_where_it_runs(fleet):
    request = body(seed=11)
    expected = unmoved(fleet, request)
    for name in ("D1", "D2"):
        fleet.faults(name, block_corrupt=1.0)
    try:
        stream, _, _, move = start_moving(fleet, request)
        result = outcome(move)
        assert result["outcome"] == "failed" and "damaged" in result["error"], result
        assert_same(stream.result(), expected)
    finally:
        for name in ("D1", "D2"):
            fleet.faults(name)
    fleet.idle()


def test_target_dies_during_the_copy(fleet):
    request = body(seed=12)
    expected = unmoved(fleet, request)
    # Slowed before the move is asked for: a read that began before its fault was set would not wait, and under
    # load the copy then finished before the kill (the move handed over).
    for name in ("D1", "D2"):
        fleet.faults(name, read_delay_s=5.0)
    stream, source, target, move = start_moving(fleet, request, after=15)
    reserving(fleet, target)
    fleet[target].kill()
    result = outcome(move)
    assert result["outcome"] == "failed", result
    assert_same(stream.result(), expected)
    fleet.restart(target)
    fleet.faults(source)
    fleet.idle()


def test_source_dies_during_the_copy(fleet):
    """The gateway restarts the request elsewhere, from its prompt and the tokens its client has."""
    request = body(seed=13, max_tokens=200)
    expected = unmoved(fleet, request)
    for name in ("D1", "D2"):
        fleet.faults(name, read_delay_s=1.0)
    stream, source, target, move = start_moving(fleet, request)
    reserving(fleet, target)
    time.sleep(0.2)  # the target holds its read grant and stalls before reading
    fleet[source].kill()
    assert_same(stream.result(), expected)
    outcome(move)
    fleet.faults(target)
    fleet.restart(source)
    fleet.idle()
    resumed = _counter(fleet, 'pdserve:gateway_migrations_total{outcome="resumed"}')
    assert resumed >= 1, "the request went on by recompute"


def test_source_dies_after_the_handover(fleet):
    """The target took the request over: the gateway attaches there, and the client misses nothing."""
    request = body(seed=14, max_tokens=200)
    expected = unmoved(fleet, request)
    stream = Stream(fleet, request)
    stream.wait_for_events(15)
    source = fleet.serving(stream.request_id)
    target = other(fleet, source)
    # Another request keeps the source stepping slowly, so the end of the moved request's window leg (its last
    # word, after the handover) waits behind a step; the source dies before it is sent.
    bystander = threading.Thread(target=_quietly, args=(f"{fleet[source].url}/v1/completions",
                                                        {**body(seed=15, max_tokens=400), "stream": False,
                                                         "stream_options": None}))
    bystander.start()
    fleet.faults(source, step_delay_s=1.0)
    r = fleet.migrate(stream.request_id, target)
    fleet[source].kill()
    assert r.status_code == 200 and r.json()["data"][0]["outcome"] == "handed_over", r.text
    assert_same(stream.result(), expected)
    bystander.join(30)
    fleet.restart(source)
    fleet.idle()


def test_client_gone_abandons_the_migration_at_once(fleet):
    request_id = uuid.uuid4().hex
    for name in ("D1", "D2"):
        fleet.faults(name, read_delay_s=2.0)
    seen = threading.Event()
    leave = threading.Event()

    def client() -> None:
        with httpx.stream("POST", f"{fleet.gateway.url}/v1/completions", json=body(seed=16, max_tokens=400),
                          headers={"X-Request-Id": request_id}, timeout=60) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n > 30:
                    seen.set()
                if leave.is_set():
                    return  # closing the connection: the client is gone

    thread = threading.Thread(target=client)
    thread.start()
    assert seen.wait(60)
    source = _serving_or_none(fleet, request_id)
    target = other(fleet, source)
    move = threading.Thread(target=fleet.migrate, args=(request_id, target))
    move.start()
    reserving(fleet, target)
    leave.set()
    thread.join(30)
    fleet.idle(timeout=LEASE_S / 3)  # explicit frees: well before any lease, deadline or reaper would free it
    move.join(60)
    for name in ("D1", "D2"):
        fleet.faults(name)
    fleet.idle()


def _quietly(url: str, request: dict) -> None:
    """A request whose instance is killed under it: its end is of no interest."""
    try:
        httpx.post(url, json=request, timeout=120)
    except httpx.HTTPError:
        pass


def _serving_or_none(fleet: Fleet, request_id: str) -> str:
    wait_for(lambda: httpx.get(f"{fleet.gateway.url}/v1/timeline/{request_id}").status_code == 200, 30, "timeline")
    return fleet.serving(request_id)


def _counter(fleet: Fleet, sample: str) -> float:
    for line in httpx.get(f"{fleet.gateway.url}/metrics").text.splitlines():
        if line.startswith(sample):
            return float(line.rsplit(" ", 1)[1])
    return 0.0

