"""Which data plane `auto` opens to a peer: shared memory only where it really connects, else the next plane.

Two real transfer agents on loopback handshake over their side channel. A producer whose shared-memory socket
is gone looks, from the consumer, exactly like one in another network namespace on the same kernel: the same
boot id, an abstract socket out of reach. tests/test_netns.py checks the same across real namespaces.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

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
