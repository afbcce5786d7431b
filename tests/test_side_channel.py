"""The side channel's request/answer contract over real ZeroMQ sockets on loopback, and what a transfer agent
does with a message that arrives before what it names."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from pdserve.gateway.capabilities import RELEASE_SIDE_CHANNEL, Capabilities, SideChannel
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.registry import Instance, Registry
from pdserve.gateway.release import KVReleaser
from pdserve.kv_transfer.agent import AgentConfig, TransferAgent
from pdserve.kv_transfer.messages import Ack, Heartbeat, Message, Release
from pdserve.kv_transfer.side_channel import SideChannelClient, SideChannelError, SideChannelServer


async def _with_server(handler, body):
    ctx = zmq.asyncio.Context()
    server = SideChannelServer(ctx, "127.0.0.1", 0, handler)
    serving = asyncio.create_task(server.serve())
    client = SideChannelClient(ctx, "127.0.0.1", server.port)
    try:
        return await body(client)
    finally:
        client.close()
        serving.cancel()
        server.close()
        ctx.term()


def test_answers_match_their_requests():
    async def echo(message: Message) -> Message:
        await asyncio.sleep(0.05 if message.keys == ["slow"] else 0)  # answers come back out of order
        return Ack(ok=True, unknown_keys=message.keys)

    async def body(client):
        return await asyncio.gather(client.request(Heartbeat(keys=["slow"]), 5),
                                    client.request(Heartbeat(keys=["fast"]), 5))

    slow, fast = asyncio.run(_with_server(echo, body))
    assert slow.unknown_keys == ["slow"] and fast.unknown_keys == ["fast"]


def test_closing_fails_waiting_requests_with_a_side_channel_error_not_a_cancellation():
    """A cancelled future would kill the caller's task past its `except SideChannelError` (and its cleanup)."""
    async def never(message: Message) -> Message:
        await asyncio.sleep(60)
        return Ack(ok=True)

    async def body(client):
        waiting = asyncio.create_task(client.request(Heartbeat(keys=["k"]), 30))
        await asyncio.sleep(0.1)
        client.close()
        with pytest.raises(SideChannelError, match="closed"):
            await waiting
        with pytest.raises(SideChannelError, match="closed"):
            await client.request(Heartbeat(keys=["k"]), 1)
        return True

    assert asyncio.run(_with_server(never, body))


def test_no_answer_within_the_deadline_is_a_side_channel_error():
    async def never(message: Message) -> Message:
        await asyncio.sleep(60)
        return Ack(ok=True)

    async def body(client):
        with pytest.raises(SideChannelError, match="within 0.2 s"):
            await client.request(Heartbeat(keys=["k"]), 0.2)
        return True

    assert asyncio.run(_with_server(never, body))


def test_a_release_that_beats_its_hold_frees_the_hold_when_it_registers():
    """P answers its client a moment before its engine thread registers the hold: a Release (a consumer's, or a
    gateway's) that arrives in between is acknowledged, and the hold is freed as soon as it registers."""
    agent = TransferAgent(AgentConfig(engine_id="P", compat_hash="same"))
    agent.start()

    async def release() -> Message:
        ctx = zmq.asyncio.Context()
        client = SideChannelClient(ctx, "127.0.0.1", agent.port)
        try:
            return await client.request(Release(key="cmpl-1", token="t" * 32, reason="decode_not_admitted"), 5)
        finally:
            client.close()
            ctx.term()

    try:
        ack = asyncio.run(release())
        assert isinstance(ack, Ack) and ack.ok
        agent.pull_producer.hold("cmpl-1", "t" * 32, [3, 4])
        assert agent.num_leases() == 0 and agent.pull_producer.take_released() == {"cmpl-1"}
    finally:
        agent.stop()


def test_a_release_of_a_hold_already_ended_counts_as_nothing_held_not_as_made():
    """A vLLM instance with PdConnector takes the gateway's release on its side channel. As over HTTP, a release is
    counted as made only when it freed something: a hold already released (or read, or expired) is acknowledged
    with its key in `unknown_keys`, and the gateway counts it under not_made="nothing_held"."""
    agent = TransferAgent(AgentConfig(engine_id="P", compat_hash="same"))
    agent.start()
    metrics = GatewayMetrics(Registry(client=None), "pull")
    caps = Capabilities("vllm", "0.32", "PdConnector", side_channel=SideChannel("P", "127.0.0.1", agent.port),
                        releases=RELEASE_SIDE_CHANNEL)
    instance = Instance(url="http://127.0.0.1:1", role="prefill", pool=None, probe_pool=None, caps=caps)

    def counted() -> tuple[float, float]:
        sample = metrics.prom.get_sample_value
        return (sample("pdserve:gateway_kv_releases_total", {"reason": "client_cancelled"}) or 0,
                sample("pdserve:gateway_kv_releases_not_made_total",
                       {"reason": "client_cancelled", "not_made": "nothing_held"}) or 0)

    async def release_twice() -> list[tuple[float, float]]:
        releaser = KVReleaser(metrics, connect_timeout_s=5, timeout_s=5)
        body = {"remote_request_id": "cmpl-7", "transfer_token": "t" * 32}
        seen = []
        for _ in range(2):
            releaser.release(instance, body, "client_cancelled")
            await releaser.drain()
            seen.append(counted())
        return seen

    try:
        agent.pull_producer.hold("cmpl-7", "t" * 32, [5, 6])
        first, second = asyncio.run(release_twice())
        assert first == (1, 0)  # the hold was there: freed
        assert agent.num_leases() == 0 and agent.pull_producer.take_released() == {"cmpl-7"}
        assert second == (1, 1)  # freed already: nothing held, not a second release
    finally:
        agent.stop()
