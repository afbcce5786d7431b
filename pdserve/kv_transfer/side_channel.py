"""The side channel: request/reply messages between instances over ZMQ (ROUTER server, DEALER clients).

Frames are [message id, msgpack body]; a client matches replies to requests by id, and every request has a
deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from pdserve.kv_transfer.faults import FaultConfig, FaultInjector
from pdserve.kv_transfer.messages import Ack, Message, ProtocolError, decode, encode

log = logging.getLogger(__name__)

Handler = Callable[[Message], Awaitable[Message]]
# Sees every message sent or received ("sent"/"received", message): for drills and tests of what crosses.
Capture = Callable[[str, Message], None]


def _no_capture(direction: str, message: Message) -> None:
    pass


class SideChannelError(RuntimeError):
    pass


class _FaultySender:
    """Sends frames through the fault injector: dropped, delayed, duplicated, reordered or corrupted."""

    def __init__(self, socket: zmq.asyncio.Socket, faults: FaultInjector) -> None:
        self.socket = socket
        self.faults = faults
        self._held: list[bytes] | None = None

    async def send(self, frames: list[bytes]) -> None:
        fate = self.faults.message_fate()
        if fate.drop:
            return
        if fate.corrupt:
            frames = [*frames[:-1], self.faults.corrupt_payload(frames[-1])]
        if fate.delay_s:
            await asyncio.sleep(fate.delay_s)
        if fate.reorder and self._held is None:
            self._held = frames  # goes out after the next message (or after a short pause)
            asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(self._flush()))
            return
        await self.socket.send_multipart(frames)
        if fate.duplicate:
            await self.socket.send_multipart(frames)
        await self._flush()

    async def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            await self.socket.send_multipart(held)


class SideChannelServer:
    def __init__(self, ctx: zmq.asyncio.Context, host: str, port: int, handler: Handler,
                 faults: FaultInjector | None = None, capture: Capture = _no_capture) -> None:
        self.capture = capture
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if port == 0:
            self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        else:
            self.socket.bind(f"tcp://{host}:{port}")
            self.port = port
        self.handler = handler
        self.sender = _FaultySender(self.socket, faults or FaultInjector(FaultConfig()))
        self._tasks: set[asyncio.Task] = set()

    async def serve(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            if len(frames) != 3:
                continue
            task = asyncio.create_task(self._answer(*frames))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, identity: bytes, message_id: bytes, body: bytes) -> None:
        try:
            message = decode(body)
            self.capture("received", message)
            reply = await self.handler(message)
        except ProtocolError as exc:
            reply = Ack(ok=False, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - a bad message must not stop the server
            log.exception("side-channel handler failed")
            reply = Ack(ok=False, error=f"{type(exc).__name__}: {exc}")
        self.capture("sent", reply)
        await self.sender.send([identity, message_id, encode(reply)])

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.socket.close(0)


class SideChannelClient:
    """One DEALER connection to a peer's side channel."""

    def __init__(self, ctx: zmq.asyncio.Context, host: str, port: int, faults: FaultInjector | None = None,
                 capture: Capture = _no_capture) -> None:
        self.capture = capture
        self.address = (host, port)
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://{host}:{port}")
        self.sender = _FaultySender(self.socket, faults or FaultInjector(FaultConfig()))
        self._ids = itertools.count(1)
        self._pending: dict[bytes, asyncio.Future] = {}
        self._closed = False
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            if len(frames) != 2:
                continue
            future = self._pending.pop(frames[0], None)
            if future is not None and not future.done():
                try:
                    reply = decode(frames[1])
                except ProtocolError as exc:
                    future.set_exception(SideChannelError(str(exc)))
                else:
                    self.capture("received", reply)
                    future.set_result(reply)

    async def request(self, message: Message, timeout: float) -> Message:
        if self._closed:
            raise SideChannelError(f"the connection to {self.address[0]}:{self.address[1]} is closed")
        message_id = next(self._ids).to_bytes(8, "big")
        future = asyncio.get_running_loop().create_future()
        self._pending[message_id] = future
        try:
            self.capture("sent", message)
            await self.sender.send([message_id, encode(message)])
            return await asyncio.wait_for(future, timeout)
        except TimeoutError as exc:
            raise SideChannelError(f"no answer from {self.address[0]}:{self.address[1]} within {timeout} s") from exc
        finally:
            self._pending.pop(message_id, None)

    def close(self) -> None:
        # Fail, never cancel, the requests in flight: a cancelled future would end the caller's task with a
        # CancelledError that its SideChannelError handler does not catch, and that task's cleanup would not run.
        self._closed = True
        self._reader.cancel()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(SideChannelError(f"the connection to {self.address[0]}:{self.address[1]} "
                                                      "was closed"))
        self.socket.close(0)
