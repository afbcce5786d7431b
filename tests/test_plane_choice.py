"""Which data plane `auto` opens to a peer: shared memory only where it really connects, else the next plane.

Two real transfer agents on loopback handshake over their side channel. A producer whose shared-memory socket
is gone looks, from the consumer, exactly like one in another network namespace on the same kernel: the same
boot id, an abstract socket out of reach. tests/test_netns.py checks the same across real namespaces.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import pdserve.kv_transfer.data_plane as registry
from pdserve.kv_transfer.agent import AgentConfig, TransferAgent
from pdserve.kv_transfer.data_plane import DataPlaneError, make_data_plane

POOL_SHAPE = (4, 2, 2, 2, 16, 8)


def make_agent(name: str, planes: list[str]) -> TransferAgent:
    made = {plane: make_data_plane(plane, "127.0.0.1") for plane in planes}
    pool = made[planes[0]].allocate(POOL_SHAPE, torch.float32)
    for plane in planes[1:]:
        made[plane].attach(pool)
    agent = TransferAgent(AgentConfig(engine_id=name, compat_hash="same", planes=made))
    agent.start()
    return agent


@pytest.fixture
def agents() -> Iterator[dict[str, TransferAgent]]:
    made = {"P": make_agent("P", ["shm", "tcp"]), "D": make_agent("D", ["shm", "tcp"])}
    yield made
    for agent in made.values():
        agent.stop()


def plane_to(consumer: TransferAgent, producer: TransferAgent) -> str:
    peer = consumer.rt.call_and_wait(consumer.peers.peer("127.0.0.1", producer.port, producer.config.engine_id), 10)
    return peer.plane


def test_auto_uses_shm_where_it_connects(agents):
    assert plane_to(agents["D"], agents["P"]) == "shm"


def test_auto_does_not_pick_an_unreachable_shm_on_the_same_kernel(agents):
    agents["P"].config.planes["shm"].stop()  # its abstract socket is gone; its boot id still matches ours
    assert agents["P"].config.planes["shm"].local_info()["host_id"] == agents["D"].config.planes["shm"].local_info()[
        "host_id"]
    assert plane_to(agents["D"], agents["P"]) == "tcp"


def test_no_plane_connects_is_an_error_naming_each_attempt():
    producer, consumer = make_agent("P", ["shm"]), make_agent("D", ["shm", "tcp"])
    try:
        producer.config.planes["shm"].stop()
        with pytest.raises(DataPlaneError, match="shm: cannot reach the peer's shared memory"):
            plane_to(consumer, producer)
    finally:
        producer.stop()
        consumer.stop()


_LOADS = """
import sys
import pdserve.kv_transfer.data_plane as registry
loaded = lambda: any(name.split(".")[0] == "mooncake" for name in sys.modules)
before = loaded()
plane = registry.make_data_plane("mooncake", "127.0.0.1")
print("mooncake" in registry.DATA_PLANES, before, loaded())
plane.stop()
"""


def test_an_optional_engine_loads_only_where_its_plane_is_made():
    # Mooncake's engine starts threads as its module loads: a process that only imports the registry (every
    # instance, the fork server) must not carry them.
    out = subprocess.run([sys.executable, "-c", _LOADS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False", "True"]


def test_a_plane_that_cannot_be_made_says_why(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ValueError, match="unknown data plane 'carrier-pigeon'; available: .*shm"):
        make_data_plane("carrier-pigeon", "127.0.0.1")
    monkeypatch.setitem(registry.OPTIONAL_PLANES, "absent", ("pdserve.no_such_plane", "Plane", "no_such_engine",
                                                             "pip install no-such-engine"))
    with pytest.raises(ValueError, match="not installed: pip install no-such-engine"):
        make_data_plane("absent", "127.0.0.1")
    # its engine's package is there, but the plane's module does not load (a system library it links is missing)
    monkeypatch.setitem(registry.OPTIONAL_PLANES, "broken", ("pdserve.no_such_plane", "Plane", "json", "a hint"))
    monkeypatch.setattr(registry, "DATA_PLANES", (*registry.DATA_PLANES, "broken"))
    with pytest.raises(ValueError, match=r"cannot load its transfer engine \(No module named .*\): a hint"):
        make_data_plane("broken", "127.0.0.1")
