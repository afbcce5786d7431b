"""pdserve's own HTTP/1.1 server for ASGI apps: httptools' parser (as the upstream client uses) under a connection
protocol that does per request only what the gateway's plain ASGI app needs (why and what it saves:
docs/decisions.md, "The gateway's front on its own HTTP/1.1 server").

What it owes clients, as uvicorn does: keep-alive with an idle timeout, pipelined requests answered in order,
`Expect: 100-continue`, chunked request and response bodies, HEAD, read and write flow control, 400 for a
malformed request and 431 for an oversized head, 500 for an app that failed before answering, a disconnect told
to the app, and a graceful stop (SIGTERM or SIGINT: stop accepting, close idle connections, let requests in
flight finish within a deadline, then cancel them; a second signal cancels at once).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import httptools

from pdserve.net.http1_exchange import STATUS_LINES, Clock, Exchange

log = logging.getLogger("pdserve.server")

# A request head past this is refused (431): clients send a few hundred bytes; 64 KiB is generous for long
# cookies or bearer tokens and keeps a connection from holding an unbounded head in memory.
MAX_HEAD_BYTES = 64 << 10
# Read from a client stops while this much of its body waits for the app to take it.
_BODY_HIGH_WATER = 64 << 10
_ASGI = {"version": "3.0", "spec_version": "2.3"}


class _HeadTooLarge(Exception):
    pass


class Http1Server:
    """Serves one ASGI app on listening sockets until a signal or `stop()`; then drains as the module says."""

    def __init__(self, app: Any, keep_alive_s: float, graceful_s: float = 30.0) -> None:
        self.app = app
        self.keep_alive_s = keep_alive_s
        self.graceful_s = graceful_s
        self.clock = Clock()
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task] = set()
        self.started = False
        self.should_exit = False
        self.on_sigterm: Callable[[], None] | None = None  # a drain to start instead of stopping
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._sweep: asyncio.TimerHandle | None = None

    def stop(self) -> None:
        self.should_exit = True
        self._stop.set()

    def watch_idle(self) -> None:
        """Idle connections are closed by one sweep a tick (a quarter of the keep-alive, at most a second), not by
        a loop timer set and cancelled for every request."""
        if self._sweep is None:
            tick = min(1.0, self.keep_alive_s / 4)
            self._sweep = asyncio.get_running_loop().call_later(tick, self._sweep_idle, tick)

    def _sweep_idle(self, tick: float) -> None:
        now = time.monotonic()
        for connection in list(self.connections):
            connection.idle_out(now)
        self._sweep = asyncio.get_running_loop().call_later(tick, self._sweep_idle, tick) if self.connections \
            else None

    def _signal(self, sig: int) -> None:
        if self.should_exit:
            self._force.set()  # a second signal: stop waiting for requests in flight
        elif sig == signal.SIGTERM and self.on_sigterm is not None:
            self.on_sigterm()
        else:
            self.stop()

    async def serve(self, sockets: list[Any]) -> None:
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(lambda: _Connection(self), sock=sock, backlog=2048) for sock in sockets]
        handled = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._signal, sig)
                handled.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                pass
        self.started = True
        try:
            await self._stop.wait()
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)
            await self._shutdown(servers)

    async def _shutdown(self, servers: list[asyncio.Server]) -> None:
        for server in servers:
            server.close()
        for connection in list(self.connections):
            connection.shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.graceful_s
        force = asyncio.ensure_future(self._force.wait())
        while self.tasks and not force.done() and loop.time() < deadline:
            await asyncio.wait([*self.tasks, force], timeout=deadline - loop.time(),
                               return_when=asyncio.FIRST_COMPLETED)
        force.cancel()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=1.0)
        for connection in list(self.connections):
            connection.transport.close()
        for server in servers:
            await server.wait_closed()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs each in a task of its own, one at a time, in order."""

    def __init__(self, server: Http1Server) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        # Pipelined requests after one that closes the connection are parsed, not refused as an error: the answers
        # owed before the close still go out (the close then drops the rest, as HTTP/1.1 says).
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None  # kept: asking asyncio for it is a system call a time
        self.local: tuple[str, int] | None = None
        self.remote: tuple[str, int] | None = None
        self.current: Exchange | None = None  # the request being answered
        self.waiting: deque[Exchange] = deque()  # pipelined requests behind it
        self.parsing: Exchange | None = None  # the request whose body is arriving
        self.read_paused = False
        self.drained: asyncio.Future | None = None  # set while the transport's write buffer is over its mark
        self.quiet_since: float | None = None  # when it last became idle (nothing in flight), for the sweep
        self.refusal: tuple[int, str] | None = None  # owed once the requests before a bad one are answered
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._continue = False

    # asyncio's protocol interface

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        self.server.connections.add(self)
        self.local = _address(transport.get_extra_info("sockname"))
        self.remote = _address(transport.get_extra_info("peername"))
        self.quiet_since = time.monotonic()
        self.server.watch_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for exchange in (self.current, *self.waiting):
            if exchange is not None:
                exchange.lost()
        self.waiting.clear()
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        while data:
            try:
                self.parser.feed_data(data)
                break
            except httptools.HttpParserUpgrade as exc:
                # No protocol here to upgrade to (h2c, websocket): the request is answered in HTTP/1.1 and parsing
                # goes on with whatever followed it.
                offset = exc.args[0] if exc.args and isinstance(exc.args[0], int) else 0
                data = data[offset:] if offset > 0 else b""
            except httptools.HttpParserCallbackError as exc:
                too_large = isinstance(exc.__context__, _HeadTooLarge)
                self.refuse(431 if too_large else 400, "request head too large" if too_large else "bad request")
                return
            except httptools.HttpParserError:
                self.refuse(400, "malformed HTTP request")
                return
        # In the middle of a head, or done: either way it may sit only so long from its last byte.
        self.quiet_since = time.monotonic() if self.current is None else None

    def pause_writing(self) -> None:
        if self.drained is None or self.drained.done():
            self.drained = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    # httptools' callbacks

    def on_message_begin(self) -> None:
        self._url, self._headers, self._head_bytes, self._continue = b"", [], 0, False

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4  # _count, inline: called for every header of every request
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._continue = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser, url = self.parser, self._url
        if url[:1] == b"/" and url.find(b"?") < 0 and url.find(b"%") < 0:  # not `in`: see _start in http1_exchange
            raw, query, path = url, b"", url.decode("ascii")
        else:
            parsed = httptools.parse_url(url)
            raw, query = parsed.path or b"/", parsed.query or b""
            path = raw.decode("latin-1")
            if "%" in path:
                path = unquote(path)
        version = parser.get_http_version()
        scope = {"type": "http", "asgi": _ASGI, "http_version": version, "server": self.local,
                 "client": self.remote, "scheme": "http", "method": parser.get_method().decode("ascii"),
                 "root_path": "", "path": path, "raw_path": raw, "query_string": query, "headers": self._headers}
        exchange = Exchange(self, scope, version != "1.0" and parser.should_keep_alive(), self._continue)
        self.parsing = exchange
        if self.current is None:
            self._start(exchange)
        else:
            self.waiting.append(exchange)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        exchange = self.parsing
        if exchange is None or exchange.complete:
            return  # answered without reading it all: the rest is discarded
        exchange.body += body
        if len(exchange.body) > _BODY_HIGH_WATER:
            self.pause_reading()
        exchange.wake()

    def on_message_complete(self) -> None:
        exchange = self.parsing
        if exchange is not None:
            exchange.more_body = False
            exchange.wake()

    # the connection's own work

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge

    def _start(self, exchange: Exchange) -> None:
        self.current = exchange
        task = self.loop.create_task(exchange.run(self.server.app))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    def answered(self, exchange: Exchange) -> None:
        """`exchange`'s whole response went out: close, or go on with the next request."""
        if self.current is exchange:
            self.current = None
        if not exchange.keep_alive or self.transport.is_closing():
            self.transport.close()
        elif self.waiting:
            self._start(self.waiting.popleft())
        elif self.refusal is not None:
            self.refuse(*self.refusal)
        else:
            self.resume_reading()
            self.quiet_since = time.monotonic()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and not self.transport.is_closing():
            self.read_paused = False
            self.transport.resume_reading()

    def shutdown(self) -> None:
        """The server is stopping: close now if idle, else after the answer in progress."""
        if self.current is None:
            self.transport.close()
        else:
            self.current.keep_alive = False
            self.waiting.clear()

    def refuse(self, status: int, message: str) -> None:
        """Answer `status` and close; after the answers owed to the requests before it, if any are in flight."""
        if self.current is not None:
            self.refusal = (status, message)
            self.pause_reading()
            return
        if not self.transport.is_closing():
            body = message.encode()
            self.transport.write(b"".join((STATUS_LINES[status], self.server.clock.date(),
                                           b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n",
                                           b"content-length: %d\r\n\r\n" % len(body), body)))
        self.transport.close()

    def idle_out(self, now: float) -> None:
        if self.current is None and self.quiet_since is not None and now - self.quiet_since >= \
                self.server.keep_alive_s:
            self.transport.close()


def _address(info: Any) -> tuple[str, int] | None:
    return (str(info[0]), int(info[1])) if isinstance(info, tuple) and len(info) >= 2 else None
