"""Membership pieces without a store: the record's wire form, `--discovery` URLs, startup mistakes (one line,
status 2), and the level-triggered reconcile (a relist corrects what a change feed missed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.membership.discovery import LEASE_EXPIRED, StaticDiscovery
from pdserve.membership.membership import Membership
from pdserve.membership.record import (DRAINING, MemberRecord, RecordError, decode_record, encode_record,
                                       kv_events_from_vllm)
from pdserve.membership.url import parse_discovery
from pdserve.server.info import InstanceInfo


def test_record_round_trip_and_refusals():
    info = InstanceInfo(engine_version="0.1.0", role="decode", kv_connector="PdConnector", protocols=["pull"])
    record = MemberRecord(url="http://10.0.0.7:8000/", role="decode", model="m", info=info, labels={"zone": "a"},
                          kv_events=kv_events_from_vllm('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                                        '"endpoint": "tcp://*:5557", "topic": "kv"}'))
    back = decode_record(encode_record(record))
    assert back.url == "http://10.0.0.7:8000" and back.info == info and back.kv_events.topic == "kv"
    assert back.kv_events.endpoint == "tcp://*:5557" and back.kv_events.replay_endpoint is None
    newer = encode_record(record).replace(b'"version":1', b'"version":2,"future_field":[1,2]')
    assert decode_record(newer).model == "m"  # a newer writer's extra fields are ignored
    for bad, why in ((b"{", "not a membership record"), (b'{"url": 7, "role": "decode"}', "not a membership"),
                     (b'{"url": "http://h:1", "role": "chef"}', "unknown role"),
                     (b'{"url": "ftp://h:1", "role": "decode"}', "http://host:port"),
                     (b'{"url": "http://h", "role": "decode"}', "http://host:port"),
                     (b'{"url": "http://h:1", "role": "decode", "state": "odd"}', "unknown state")):
        with pytest.raises(RecordError, match=why):
            decode_record(bad)


def test_kv_events_follow_vllm_defaults():
    assert kv_events_from_vllm(None) is None
    assert kv_events_from_vllm('{"endpoint": "tcp://*:1"}') is None  # vLLM: events off unless enabled
    assert kv_events_from_vllm('{"enable_kv_cache_events": true}').endpoint == "tcp://*:5557"
    assert kv_events_from_vllm('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    with pytest.raises(RecordError, match="not valid JSON"):
        kv_events_from_vllm("{oops")


def test_discovery_urls():
    spec = parse_discovery("etcd://10.0.0.1:2379,10.0.0.2:2379/prod/fleet/")
    assert spec.endpoints == ("10.0.0.1:2379", "10.0.0.2:2379") and spec.prefix == "/prod/fleet"
    assert parse_discovery("etcd://h:2379").prefix == "/pdserve"
    assert parse_discovery("k8s").kind == "k8s" and parse_discovery("k8s://serving").namespace == "serving"
    for bad in ("etcd://h/p", "etcd://h:99999/p", "consul://h:1/p", "etcd://h:1/p?x=1", "k8s://Bad_NS", "etcd:/h"):
        with pytest.raises(ValueError, match="cannot parse --discovery"):
            parse_discovery(bad)


@pytest.mark.parametrize("argv", [
    ["gateway", "--discovery", "etcd://nowhere/p"],
    ["gateway", "--discovery", "zookeeper://h:1/p"],
    ["register", "--discovery", "etcd://h:1/p", "--url", "http://127.0.0.1:1", "--role", "decode",
     "--kv-events-config", "[1]"],
    ["register", "--discovery", "k8s", "--url", "http://127.0.0.1:1", "--role", "decode"],
    ["serve", "/nonexistent-model", "--discovery", "etcd://h/p"],
])
def test_a_discovery_mistake_stops_the_process_with_one_line(argv):
    run = subprocess.run([sys.executable, "-m", "pdserve", *argv], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "--" in lines[0], run.stderr


def _membership() -> tuple[Membership, list]:
    log: list = []
    membership = Membership([StaticDiscovery([]), StaticDiscovery([])], lambda r: log.append(("join", r.url)),
                            lambda url: log.append(("leave", url)))
    membership.sources[1].name = "store"
    return membership, log


def test_reconcile_counts_causes_and_corrects_on_relist():
    membership, log = _membership()
    a = MemberRecord(url="http://a:1", role="prefill")
    b = MemberRecord(url="http://b:1", role="decode")
    membership.replace("store", {"ka": a, "kb": b}, relist=True)  # the first list: joins
    assert log == [("join", "http://a:1"), ("join", "http://b:1")] and membership.changes == {"joined": 2}
    membership.replace("store", {"ka": a}, relist=False, causes={"kb": LEASE_EXPIRED})
    membership.replace("store", {"ka": MemberRecord(url="http://a:1", role="prefill", state=DRAINING)},
                       relist=False)
    assert membership.changes == {"joined": 2, "lease_expired": 1, "left": 1}
    membership.replace("store", {"kb": b}, relist=True)  # a later list that differs: the feed missed it
    assert membership.changes["relist_correction"] == 1 and ("join", "http://b:1") == log[-1]
    membership.replace("store", {"kb": b}, relist=True)  # the same list again changes nothing
    assert membership.changes["relist_correction"] == 1


def test_a_url_stays_a_member_while_any_backend_lists_it():
    membership, log = _membership()
    a = MemberRecord(url="http://a:1", role="both")
    membership.replace("static", {"http://a:1": a}, relist=True)
    membership.replace("store", {"k": a}, relist=True)
    membership.replace("store", {}, relist=False)
    assert log == [("join", "http://a:1")] and "http://a:1" in membership.members
    membership.set_stale("store", "connection refused")
    assert membership.stale == {"store": "connection refused"}
    membership.set_stale("store", None)
    assert membership.stale == {}
