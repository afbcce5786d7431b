"""Membership on a real etcd (Debian's etcd-server, a three-member cluster on loopback): instances register
themselves, two gateways follow the same prefix, and the fleet survives crashes, drains, etcd member loss,
quorum loss and an etcd restored empty.

One cluster, one tiny model and one fleet (P, D and a colocated B, whose direct answer is the oracle) are shared
by the module; tests that kill or drain an instance start their own. Leases are 2 s and relists 2 s, so what the
issue bounds by a TTL or a relist period shows up in seconds; every wait is on a condition with a generous
deadline (the box is shared), never a timed assertion.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from pdserve.launcher import start, start_command, start_instance, stop_all
from pdserve.membership.etcd_client import EtcdClient
from pdserve.membership.record import decode_record, member_key
import etcd_cluster
from server_utils import metric_values, wait_for, wait_until_idle

pytestmark = pytest.mark.skipif(not etcd_cluster.available() and os.environ.get("CI") != "true",
                                reason="etcd-server is not installed (make install installs it)")

TTL = "2"
ADMIN = {"Authorization": "Bearer adm1n"}
BODY = {"model": "tiny", "prompt": "the fleet keeps serving", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
INSTANCE_FLAGS = ("--num-kv-blocks", "64", "--max-model-len", "256", "--served-model-name", "tiny",
                  "--discovery-ttl", TTL, "--admin-token", "adm1n", "--log-level", "info")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    cluster = etcd_cluster.EtcdCluster(tmp_path_factory.mktemp("etcd"), 3).start()
    yield cluster
    cluster.stop()


def instance(model: Path, url: str, role: str, name: str, *extra: str):
    kv = [] if role == "both" else ["--role", role]
    return start_instance(model, *kv, *INSTANCE_FLAGS, "--discovery", url, *extra, name=name)


def gateway(url: str, *extra: str):
    return start("gateway", ["gateway", "--port", "0", "--discovery", url, "--discovery-relist-seconds", "2",
                             "--protocol", "pull", "--admin-token", "adm1n", "--health-check-interval", "0.5",
                             *extra])


@pytest.fixture(scope="module")
def fleet(etcd, models):
    model = models("llama")
    url = etcd.url("/fleet")
    procs = {}
    try:
        procs["B"] = instance(model, url, "both", "B")
        procs["P"] = instance(model, url, "prefill", "P")
        procs["D"] = instance(model, url, "decode", "D")
        procs["G1"], procs["G2"] = gateway(url), gateway(url)
        for g in (procs["G1"], procs["G2"]):
            wait_for(lambda g=g: healthy(g) == {procs[n].url for n in "BPD"}, 60, "both gateways see the fleet")
        procs["oracle"] = httpx.post(procs["B"].url + "/v1/completions", json=BODY, timeout=60).json()
        yield model, url, procs
    finally:
        for name, proc in procs.items():
            if name != "oracle":
                proc.stop()


def exit_status(proc, seconds: float) -> int:
    """A drained instance's exit status; past `seconds`, a failure that carries its log (the drain's own lines say
    what it waited for)."""
    try:
        return proc.popen.wait(seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{proc.name} did not exit within {seconds} s of its drain:\n{proc.log_tail(6000)}")


def members(g) -> set[str]:
    return {i["url"] for i in httpx.get(g.url + "/instances", timeout=10).json()}


def healthy(g) -> set[str]:
    return {i["url"] for i in httpx.get(g.url + "/instances", timeout=10).json() if i["healthy"]}


def changes(g, cause: str) -> float:
    text = httpx.get(g.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f'pdserve:gateway_membership_changes_total{{cause="{cause}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no membership change counter for {cause}")


def stale(g) -> float:
    return metric_values(g.url).get("pdserve:gateway_membership_stale", -1)


def assert_serves(g, oracle: dict, n: int = 3) -> None:
    for _ in range(n):
        r = httpx.post(g.url + "/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == oracle["choices"][0]["text"]


def test_two_gateways_serve_one_fleet_from_etcd(fleet):
    _, _, procs = fleet
    for g in (procs["G1"], procs["G2"]):
        assert_serves(g, procs["oracle"])
        assert changes(g, "joined") >= 3
        assert stale(g) == 0
    assert "registered prefill instance" in procs["P"].log_tail(20000)


def test_register_writes_through_and_bad_records_are_skipped(fleet, etcd):
    _, url, procs = fleet
    g1, g2 = procs["G1"], procs["G2"]
    ghost = "http://127.0.0.1:9"  # nothing answers there: a member, never routed to
    r = httpx.post(g1.url + "/register", headers=ADMIN, json={
        "url": ghost, "role": "decode", "model": "tiny",
        "kv_events": {"endpoint": "tcp://127.0.0.1:5557", "topic": "kv"}})
    assert r.status_code == 200, r.text
    wait_for(lambda: ghost in members(g2), 20, "a registration on one gateway reaching the other")
    assert ghost not in healthy(g2)
    assert_serves(g2, procs["oracle"])
    stored = asyncio.run(_get(etcd.endpoints, member_key("/fleet", ghost)))
    assert stored.kv_events is not None and stored.kv_events.endpoint == "tcp://127.0.0.1:5557"
    assert httpx.post(g2.url + "/deregister", headers=ADMIN, json={"url": ghost}).status_code == 200
    wait_for(lambda: ghost not in members(g1), 20, "a deregistration on one gateway reaching the other")

    bad_key = "/fleet/members/garbage"
    asyncio.run(_put(etcd.endpoints, bad_key, b'{"url": 7, "role": "decode"}'))
    wait_for(lambda: f"skipping the record at etcd key {bad_key}" in g1.log_tail(200000), 20, "the warning")
    assert g1.log_tail(200000).count(f"skipping the record at etcd key {bad_key}") == 1
    assert healthy(g1) == {procs[n].url for n in "BPD"}
    assert_serves(g1, procs["oracle"])
    asyncio.run(_delete(etcd.endpoints, bad_key))


def test_crash_leaves_within_the_lease_and_a_drain_leaves_at_once(fleet):
    model, url, procs = fleet
    g1, g2 = procs["G1"], procs["G2"]
    crash = instance(model, url, "decode", "D-crash")
    try:
        wait_for(lambda: crash.url in healthy(g1) and crash.url in healthy(g2), 30, "a new instance routable")
        expired = changes(g1, "lease_expired")
        crash.kill()
        for g in (g1, g2):
            wait_for(lambda g=g: crash.url not in members(g), 20, "a SIGKILLed instance gone with its lease")
        assert changes(g1, "lease_expired") == expired + 1
    finally:
        crash.stop()

    drained = instance(model, url, "decode", "D-drain")
    static = start("gateway", ["gateway", "--port", "0", "--protocol", "pull", "--prefill", procs["P"].url,
                               "--decode", drained.url, procs["D"].url])  # no store: it learns from /health
    try:
        wait_for(lambda: drained.url in healthy(g1) and drained.url in healthy(static), 30, "routable everywhere")
        left = changes(g1, "left")
        loads = [_load(g, procs["oracle"], seconds=4.0) for g in (g1, static)]
        assert httpx.post(drained.url + "/admin/drain", json={}).status_code == 401  # behind the admin token
        assert httpx.post(drained.url + "/admin/drain", headers=ADMIN, json={}).status_code == 202
        assert exit_status(drained, 30) == 0
        for g in (g1, g2):
            wait_for(lambda g=g: drained.url not in members(g), 5, "a drained instance gone")
        assert changes(g1, "left") == left + 1
        for load in loads:
            load.join()
            assert load.failures == [] and load.count > 0
        assert "is draining: no new work" in static.log_tail(100000)
    finally:
        stop_all([static, drained])
    for name in "BPD":
        wait_until_idle(procs[name].url)


def test_a_gateway_killed_and_an_instance_stopped_under_load_lose_nothing(fleet):
    """Active-active: a client that retries on another gateway (as the OpenAI SDK retries, behind a load
    balancer) loses nothing when one gateway is SIGKILLed; SIGTERM drains an instance (exit 0) meanwhile."""
    model, url, procs = fleet
    g3 = gateway(url)
    extra = instance(model, url, "decode", "D-term")
    try:
        wait_for(lambda: extra.url in healthy(g3) and extra.url in healthy(procs["G1"]), 30, "the fleet seen")
        load = _load([g3, procs["G1"]], procs["oracle"], seconds=4.0)
        wait_for(lambda: load.count >= 3, 30, "some requests through both gateways")
        g3.kill()
        extra.popen.send_signal(signal.SIGTERM)
        assert exit_status(extra, 30) == 0
        load.join()
        assert load.failures == [] and load.count > 3
        assert load.retried > 0  # the dead gateway's share went to the other one
        wait_for(lambda: extra.url not in members(procs["G1"]), 10, "a stopped instance gone")
    finally:
        stop_all([extra, g3])


def test_etcd_member_loss_quorum_loss_and_an_empty_etcd(fleet, etcd):
    _, _, procs = fleet
    g1 = procs["G1"]
    etcd.members[0].kill()
    assert_serves(g1, procs["oracle"])
    etcd.members[1].kill()  # quorum lost: gateways serve the members they have
    wait_for(lambda: stale(g1) == 1, 20, "the gateway saying it cannot reach etcd")
    assert_serves(g1, procs["oracle"])
    assert "cannot reach the etcd store" in g1.log_tail(200000)
    for member in etcd.members[:2]:
        etcd.start_member(member)
    wait_for(lambda: stale(g1) == 0, 20, "the gateway catching up with etcd")
    assert healthy(g1) == {procs[n].url for n in "BPD"}

    etcd.wipe()  # restored empty: every instance registers again under a new lease
    for g in (g1, procs["G2"]):
        wait_for(lambda g=g: healthy(g) == {procs[n].url for n in "BPD"}, 30, "instances registered again")
    assert "registering again" in procs["P"].log_tail(200000)
    assert_serves(g1, procs["oracle"])


def test_sidecar_holds_a_registration_while_health_answers(fleet, tmp_path):
    _, url, procs = fleet
    fake = str(Path(__file__).with_name("fake_vllm.py"))
    vllm = start_command("fake-vllm", [sys.executable, fake, "--record", str(tmp_path / "v.jsonl")])
    port = vllm.port
    events = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}'
    sidecar = start("register", ["register", "--discovery", url, "--url", vllm.url, "--role", "decode", "--model",
                                 "fake", "--kv-events-config", events, "--discovery-ttl", TTL,
                                 "--health-interval", "0.2"])
    g1 = procs["G1"]
    try:
        wait_for(lambda: vllm.url in members(g1), 20, "the sidecar registering the instance")
        not_ready = changes(g1, "not_ready")
        vllm.kill()
        wait_for(lambda: vllm.url not in members(g1), 20, "the sidecar giving the registration up")
        assert changes(g1, "not_ready") == not_ready + 1
        vllm = start_command("fake-vllm", [sys.executable, fake, "--record", str(tmp_path / "v.jsonl"),
                                           "--port", str(port)])
        wait_for(lambda: vllm.url in members(g1), 20, "the sidecar registering it again")
        sidecar.popen.send_signal(signal.SIGTERM)
        assert sidecar.popen.wait(20) == 0
        wait_for(lambda: vllm.url not in members(g1), 20, "a stopped sidecar's registration gone")
    finally:
        stop_all([sidecar, vllm])


def test_an_instance_answering_as_another_model_is_not_routed_to(fleet):
    _, _, procs = fleet
    b = procs["B"].url
    g = start("gateway", ["gateway", "--port", "0", "--protocol", "colocated", "--admin-token", "adm1n",
                          "--health-check-interval", "0.5"])
    try:
        r = httpx.post(g.url + "/register", headers=ADMIN, json={"url": b, "role": "both", "model": "other"})
        assert r.status_code == 200 and r.json()["healthy"] is False
        assert httpx.post(g.url + "/v1/completions", json=BODY, timeout=30).status_code == 503
        assert "serves model 'tiny', but registered as 'other'" in g.log_tail(20000)
        httpx.post(g.url + "/register", headers=ADMIN, json={"url": b, "role": "both", "model": "tiny"})
        wait_for(lambda: b in healthy(g), 20, "the instance routable once its record names its model")
        assert_serves(g, procs["oracle"], 1)
    finally:
        g.stop()


class _Load(threading.Thread):
    """Sequential requests until `seconds` pass, each checked against the oracle, round-robin over gateways; one
    that cannot be reached is retried once on the next (the OpenAI SDK retries connection errors)."""

    def __init__(self, gateways: list, oracle: dict, seconds: float) -> None:
        super().__init__(daemon=True)
        self.gateways, self.oracle, self.seconds = gateways, oracle, seconds
        self.count, self.retried, self.failures = 0, 0, []

    def run(self) -> None:
        import time

        end = time.monotonic() + self.seconds
        with httpx.Client(timeout=60) as client:
            while time.monotonic() < end:
                self.count += 1
                self._one(client)

    def _one(self, client: httpx.Client) -> None:
        for attempt in range(2):
            g = self.gateways[(self.count + attempt) % len(self.gateways)]
            try:
                r = client.post(g.url + "/v1/completions", json=BODY)
            except httpx.TransportError:
                self.retried += 1
                continue
            if r.status_code != 200 or r.json()["choices"][0]["text"] != self.oracle["choices"][0]["text"]:
                self.failures.append((r.status_code, r.text[:200]))
            return
        self.failures.append("no gateway answered")


def _load(gateways, oracle: dict, seconds: float) -> _Load:
    load = _Load(gateways if isinstance(gateways, list) else [gateways], oracle, seconds)
    load.start()
    return load


async def _get(endpoints: str, key: str):
    client = EtcdClient(endpoints.split(","))
    try:
        kvs, _ = await client.get_prefix(key.encode())
        return decode_record(kvs[0].value)
    finally:
        await client.close()


async def _put(endpoints: str, key: str, value: bytes) -> None:
    client = EtcdClient(endpoints.split(","))
    try:
        await client.put(key.encode(), value)
    finally:
        await client.close()


async def _delete(endpoints: str, key: str) -> None:
    client = EtcdClient(endpoints.split(","))
    try:
        await client.delete(key.encode())
    finally:
        await client.close()
