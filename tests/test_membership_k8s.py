"""Kubernetes membership against FakeKubeApiServer (tests/fake_kube_api.py): a FAKE API server, because none can
run on these machines. It speaks the API server's list/watch wire shapes (PodList, watch events, bookmarks, the
410 Gone Status); the gateway is the real one, with the real Kubernetes client, reading it through a kubeconfig.

A pod is a member only while it is Running, Ready and matches; NotReady, a label change and deletion each take it
out; a delete the watch never delivered is corrected by the next relist; a watch from an expired version relists.
"""

from __future__ import annotations

import httpx
import pytest

from fake_kube_api import FakeKubeApiServer, make_pod
from pdserve.launcher import start
from server_utils import wait_for


@pytest.fixture
def api(tmp_path):
    server = FakeKubeApiServer(tmp_path).start()
    yield server
    server.stop()


def gateway(api: FakeKubeApiServer, *flags: str):
    return start("gateway", ["gateway", "--port", "0", "--discovery", "k8s://fleet", "--discovery-relist-seconds",
                             "2", "--log-level", "info", *flags], env={"KUBECONFIG": str(api.kubeconfig())})


def members(g) -> dict[str, str]:
    return {i["url"]: i["role"] for i in httpx.get(g.url + "/instances", timeout=10).json()}


def changes(g) -> dict[str, float]:
    out = {}
    for line in httpx.get(g.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve:gateway_membership_changes_total{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def test_role_selectors_readiness_labels_and_missed_events(api):
    api.put(make_pod("p-0", "127.0.0.1", 41001, {"app": "p"}))
    api.put(make_pod("d-0", "127.0.0.1", 41002, {"app": "d"}))
    api.put(make_pod("d-starting", "127.0.0.1", 41003, {"app": "d"}, ready=False, phase="Pending"))
    g = gateway(api, "--prefill-selector", "app=p", "--decode-selector", "app=d")
    try:
        # The gateway waits 5 s for its first list, then starts with what it has: on a loaded box (a full suite
        # beside it) the Kubernetes client's import and first list once took longer.
        wait_for(lambda: members(g) == {url(41001): "prefill", url(41002): "decode"}, 20, "the first list")
        api.put(make_pod("d-starting", "127.0.0.1", 41003, {"app": "d"}))  # now Running and Ready
        wait_for(lambda: url(41003) in members(g), 10, "a pod that turned Ready")
        api.put(make_pod("d-starting", "127.0.0.1", 41003, {"app": "d"}, ready=False))
        wait_for(lambda: url(41003) not in members(g), 10, "a pod that turned NotReady")
        api.put(make_pod("d-0", "127.0.0.1", 41002, {"app": "other"}))
        wait_for(lambda: url(41002) not in members(g), 10, "a pod that stopped matching")
        assert changes(g)["not_ready"] == 1

        api.drop_events = True  # this delete never reaches the watch
        api.delete("p-0")
        api.drop_events = False
        wait_for(lambda: url(41001) not in members(g), 10, "the next relist correcting a missed delete")
        assert changes(g)["relist_correction"] >= 1
        assert "left (relist_correction" in g.log_tail(100000)
    finally:
        g.stop()


def test_llm_d_role_labels_and_a_watch_from_an_expired_version(api):
    api.put(make_pod("a", "127.0.0.1", 41011, {"llm-d.ai/role": "prefill", "llm-d.ai/model": "tiny"}))
    api.put(make_pod("b", "127.0.0.1", 41012, {"llm-d.ai/role": "prefill-decode"}))
    api.put(make_pod("c", "127.0.0.1", 41013, {"llm-d.ai/role": "sidecar"}))  # no role pdserve serves
    g = gateway(api, "--selector", "llm-d.ai/role", "--discovery-relist-seconds", "30")
    try:
        wait_for(lambda: members(g) == {url(41011): "prefill", url(41012): "both"}, 20, "the first list")
        api.put(make_pod("d", "127.0.0.1", 41014, {"llm-d.ai/role": "decode"}))
        wait_for(lambda: url(41014) in members(g), 10, "a pod added while watching")
        lists = api.lists
        api.drop_events = True  # lost with the stream that is cut next...
        api.delete("a")
        api.drop_events = False
        api.compact()  # ...and compacted away: watching on from the last version seen gets 410 Gone
        api.cut_watches()
        wait_for(lambda: url(41011) not in members(g), 10, "a relist after 410 Gone")
        assert api.gone >= 1 and api.lists > lists
        assert "410 Gone" in g.log_tail(100000)
    finally:
        g.stop()
