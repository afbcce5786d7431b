"""The transfer agent: an instance's cross-instance work, on its own asyncio thread.

It owns the thread, the side-channel server and the dispatch of each incoming message to the one owner of
the state it concerns: ``PullProducer`` (P's leases and grants), ``PullConsumer`` (D's loads and heartbeats),
``ProducerLink`` and ``PushConsumer`` (the two ends of push) and ``Peers`` (handshakes and connections). It
also routes every data-plane access to the owner that can authorise it. The engine thread talks to the owners
only through their thread-safe methods; results come back through ``take_*``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import zmq.asyncio

from pdserve.ids import TransferId
from pdserve.kv_transfer.capture import MessageCapture
from pdserve.kv_transfer.faults import FaultConfig, FaultInjector
from pdserve.kv_transfer.messages import (Ack, Handshake, Heartbeat, Message, PushRegister, ReadDone, ReadGrant,
                                          Release, WriteDone)
from pdserve.kv_transfer.peers import Peers
from pdserve.kv_transfer.pull_consumer import PullConsumer
from pdserve.kv_transfer.pull_producer import PullProducer
from pdserve.kv_transfer.push import ProducerLink, PushConsumer
from pdserve.kv_transfer.runtime import AgentConfig, AgentRuntime, AgentStats, LoadResult
from pdserve.kv_transfer.side_channel import SideChannelServer
from pdserve.kv_transfer.vllm_nixl.producer import VllmNixlProducer

__all__ = ["AgentConfig", "TransferAgent"]

Handler = Callable[[Any], Awaitable[Message]]


class TransferAgent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.rt = AgentRuntime(config, faults=FaultInjector(config.faults))
        self.capture = MessageCapture(config.capture_path, config.engine_id)
        self.peers = Peers(self.rt, self.capture)
        self.pull_producer = PullProducer(self.rt)
        self.pull_consumer = PullConsumer(self.rt, self.peers)
        self.push_producer = ProducerLink(self.rt, self.peers)
        self.push_consumer = PushConsumer(self.rt, self.peers)
        self._handlers: dict[type[Message], Handler] = {
            Handshake: self.peers.on_handshake,
            ReadGrant: self.pull_producer.on_read_grant,
            ReadDone: self.pull_producer.on_read_done,
            Heartbeat: self.pull_producer.on_heartbeat,
            Release: self._on_release,
            PushRegister: self.push_producer.on_register,
            WriteDone: self.push_consumer.on_write_done,
        }
        self.vllm_producer: VllmNixlProducer | None = None  # vLLM decoders' side channel and mirror, if enabled
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._tasks: list[asyncio.Task] = []
        self._server: SideChannelServer | None = None
        self._ctx: zmq.asyncio.Context | None = None

    @property
    def stats(self) -> AgentStats:
        return self.rt.stats

    @property
    def faults(self) -> FaultInjector:
        return self.rt.faults

    @property
    def port(self) -> int:
        """The side channel's port, once the agent has started."""
        return self.rt.port

    @property
    def on_event(self) -> Callable[[], None]:
        return self.rt.on_event

    @on_event.setter
    def on_event(self, wake: Callable[[], None]) -> None:
        """Wakes the engine loop when a transfer event lands."""
        self.rt.on_event = wake

    # == thread-safe API (engine thread) ==================================================================
    def start(self) -> None:
        for plane in self.config.planes.values():
            plane.start(self._authorize)
        self._thread = threading.Thread(target=self._run_loop, name="pdserve-agent", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the transfer agent did not start")

    def stop(self) -> None:
        loop = self.rt.loop
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        for plane in self.config.planes.values():
            plane.stop()
        self.rt.executor.shutdown(wait=False, cancel_futures=True)
        self.push_producer.close()
        self.capture.close()

    def release_local(self, key: str | None, token: str, transfer_id: TransferId | None) -> bool:
        """Free a transfer on its client's (or gateway's) request: a push this instance awaits, or a held pull."""
        if transfer_id is not None and self.push_consumer.give_up(transfer_id):
            return True
        return self.pull_producer.release(key, token, transfer_id)

    def take_completed(self) -> list[LoadResult]:
        """Consumer transfers that ended since the last call, pull loads and pushes alike."""
        return self.pull_consumer.take_completed() + self.push_consumer.take_completed()

    def send_release(self, host: str, port: int, key: str, token: str, reason: str) -> None:
        self.pull_consumer.send_release(host, port, key, token, reason)

    def set_faults(self, config: FaultConfig) -> None:
        """Replace the fault injector (a drill switch). Readers take the reference once, so this is atomic."""
        self.rt.faults = FaultInjector(config)
        if self._server is not None:
            self._server.sender.faults = self.rt.faults
        self.peers.set_faults(self.rt.faults)

    def num_leases(self) -> int:
        return self.pull_producer.num_leases()

    def num_expected(self) -> int:
        return self.push_consumer.num_expected()

    # == the agent thread =================================================================================
    def _run_loop(self) -> None:
        loop = asyncio.new_event_loop()
        self.rt.loop = loop
        asyncio.set_event_loop(loop)
        self._ctx = zmq.asyncio.Context()
        self.peers.start(self._ctx)
        self._server = SideChannelServer(self._ctx, self.config.host, self.config.port, self._handle,
                                         self.rt.faults, self.capture)
        self.rt.port = self._server.port
        self._tasks = [loop.create_task(self._server.serve()), loop.create_task(self.pull_producer.reap()),
                       loop.create_task(self.pull_consumer.heartbeat()), loop.create_task(self.push_consumer.watch())]
        if self.vllm_producer is not None:
            self.vllm_producer.bind(self._ctx)
            self._tasks += [loop.create_task(self.vllm_producer.serve()), loop.create_task(self.vllm_producer.poll())]
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.peers.close()
        if self.vllm_producer is not None:
            self.vllm_producer.close()
        if self._server is not None:
            self._server.close()
        if self._ctx is not None:
            self._ctx.term()

    async def _handle(self, message: Message) -> Message:
        handler = self._handlers.get(type(message))
        if handler is None:
            return Ack(ok=False, error=f"unsupported message {type(message).__name__}")
        return await handler(message)

    async def _on_release(self, message: Release) -> Ack:
        """A consumer (or a gateway) gave up: end the lease it names. A key held by no lease may name a push
        transfer, or a hold the engine thread has yet to register (P answers a moment before): push is told, and
        the lease's end is remembered until its hold arrives."""
        self.stats.releases_received += 1
        if not self.pull_producer.is_held(message.key):
            await self.push_producer.on_release(message.key, message.token)  # answered once no write can land
        self.rt.on_event()
        return self.pull_producer.end_released(message.key, message.token)

    def _authorize(self, op: str, key: str, token: str, block_ids: list[int]) -> str | None:
        """The capability check every data-plane access passes, by the owner of what it touches: a read of
        P's held blocks (a lease), or a write into D's registered blocks (a push registration)."""
        if op == "read":
            return self.pull_producer.authorize_read(key, token, block_ids)
        return self.push_consumer.authorize_write(key, token, block_ids)
