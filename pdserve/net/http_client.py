"""A keep-alive HTTP/1.1 client for proxying: pooled connections, httptools parsing, deadlines on every wait.

Chosen by measurement over aiohttp's client (about 4x less CPU per request; docs/decisions.md): a gateway makes
two upstream calls per request, so this cost is most of its budget. Parsing is httptools' (the parser uvicorn
uses); this module only pools connections, writes requests and exposes the body as it arrives.

Closing a response before its end closes the connection: the upstream server sees the client leave and aborts
the request, which is how a gateway cancels a leg.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import httptools

from pdserve.net.sweeper import Sweeper

# A wait this long or longer (a leg's head, minutes) is checked by the pool's sweeper, at most _SWEEP_TICK_S late,
# instead of a loop timer of its own; a shorter one (a health check's scrape, a test's) keeps its exact timer.
_SWEPT_FROM_S = 1.0
_SWEEP_TICK_S = 0.1


class UpstreamError(ConnectionError):
    """The upstream could not be reached, or broke the connection mid-answer."""


class UpstreamTimeout(TimeoutError):
    def __init__(self, stage: str, seconds: float) -> None:
        super().__init__(f"{stage} took longer than {seconds:g} s")
        self.stage = stage


class _Connection(asyncio.Protocol):
    def __init__(self, pool: HttpPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # kept: asking asyncio for it is a system call a time
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.reused = False  # taken from the idle pool rather than freshly connected
        self.received = False  # any byte of the current answer came back

    # -- asyncio.Protocol -----------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed response: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        self.closed = True  # the upstream will not take another request here; keep it out of the pool
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(UpstreamError(f"connection lost: {exc or 'closed by the upstream'}"))

    # -- httptools callbacks (no on_header: the gateway reads no upstream header, and httptools then calls none) --
    def on_headers_complete(self) -> None:
        r = self.response
        if r is not None:
            r.status = self.parser.get_status_code()
            r.keep_alive = self.parser.should_keep_alive()
            r._headers_done()

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        r, self.response = self.response, None
        if r is None:
            return
        r._finish()
        if r.keep_alive and not self.closed:
            self.pool._release(self)
        else:
            self.close()

    # -- helpers --------------------------------------------------------------------------------------------
    def _fail(self, exc: Exception) -> None:
        r, self.response = self.response, None
        if r is not None:
            r._error(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _HeaderConnection(_Connection):
    """A connection that keeps the answer's headers named in `wanted`: a class of its own because httptools calls
    `on_header` on any protocol that defines it, and the proxy path reads no header at all."""

    def __init__(self, pool: HttpPool, wanted: frozenset[bytes]) -> None:
        super().__init__(pool)
        self.wanted = wanted

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        r = self.response
        if r is not None and name in self.wanted:
            if r.header_values is None:
                r.header_values = {}
            r.header_values[name] = value


class Response:
    """An upstream answer: status as soon as the head arrived, the body as it arrives.

    Waits are plain futures with one timer each (`loop.call_later`), made only when a reader must wait: most small
    answers arrive whole with their head, and are read without a wait, a timer or a task switch.
    """

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.keep_alive = False
        self._head = False
        self._chunks: deque[bytes] = deque()
        self._waiter: asyncio.Future | None = None  # a reader waiting for the head or for more body
        self._done = False
        self._exc: Exception | None = None
        # Only those its pool reads (`HttpPool.read_headers`); None until one came: a proxied answer makes no dict.
        self.header_values: dict[bytes, bytes] | None = None

    def header(self, name: bytes) -> bytes | None:
        return None if self.header_values is None else self.header_values.get(name.lower())

    @property
    def reused_connection(self) -> bool:
        """It came on a connection kept alive from an earlier answer: the same upstream process answered both."""
        return self._conn.reused

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _headers_done(self) -> None:
        self._head = True
        self._wake()

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _error(self, exc: Exception) -> None:
        self._exc = exc
        self._wake()

    async def _wait(self, timeout: float | None, stage: str) -> None:
        """Until the connection has news for this response (or `timeout` passed: abort, UpstreamTimeout)."""
        loop = self._conn.loop
        waiter = self._waiter = loop.create_future()
        timer = sweeper = None
        if timeout is not None:
            if timeout >= _SWEPT_FROM_S:
                sweeper = self._conn.pool.deadlines
                sweeper.add(waiter, timeout, _expire, loop)
            else:
                timer = loop.call_later(timeout, _expire, waiter)
        try:
            expired = await waiter
        except asyncio.CancelledError:
            self.abort()  # a reader that gives up mid-answer must not leave the upstream working for nobody
            raise
        finally:
            if timer is not None:
                timer.cancel()
            elif sweeper is not None:
                sweeper.discard(waiter)
        if expired:
            self.abort()
            raise UpstreamTimeout(stage, timeout or 0)

    async def headers(self, timeout: float | None) -> None:
        """Until the status and headers arrived; the transport's failure, or UpstreamTimeout, otherwise."""
        while not self._head:
            if self._exc is not None:
                raise self._exc
            if self._done:
                raise UpstreamError("the request was aborted before its answer")
            await self._wait(timeout, "waiting for the response")

    async def chunks(self, idle_timeout: float | None = None) -> AsyncIterator[bytes]:
        """The body as it arrives; `idle_timeout` bounds the gap between chunks."""
        while True:
            while self._chunks:
                yield self._chunks.popleft()
            if self._done:
                return
            if self._exc is not None:
                raise self._exc
            await self._wait(idle_timeout, "waiting for the next chunk")

    async def read(self, timeout: float | None = None) -> bytes:
        """The whole body, within `timeout` from now."""
        loop = self._conn.loop
        deadline = None if timeout is None else loop.time() + timeout
        parts = []
        while True:
            while self._chunks:
                parts.append(self._chunks.popleft())
            if self._done:
                return b"".join(parts)
            if self._exc is not None:
                raise self._exc
            left = None if deadline is None else max(deadline - loop.time(), 0.0)
            try:
                await self._wait(left, "reading the response body")
            except UpstreamTimeout:
                raise UpstreamTimeout("reading the response body", timeout or 0) from None

    def abort(self) -> None:
        """Stop reading: the connection is closed, and the upstream sees its client leave."""
        if not self._done:
            self._conn.close()
            self._done = True
            self._wake()


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(True)


class HttpPool:
    """Keep-alive connections to one upstream (host, port). Answers' headers are not kept, except those named
    (lower case) in `read_headers`: a pool that reads some keeps connections of its own kind."""

    def __init__(self, host: str, port: int, max_idle: int = 64,
                 headers: list[tuple[bytes, bytes]] | None = None,
                 read_headers: frozenset[bytes] = frozenset()) -> None:
        self.host = host
        self.port = port
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self.host_header = f"{host}:{port}".encode()
        self.headers = headers or []  # sent with every request (the upstream's credentials)
        # The part of every request's head that never changes, joined once.
        self._fixed_head = b"".join([b" HTTP/1.1\r\nhost: ", self.host_header, b"\r\n",
                                     *(b"%s: %s\r\n" % pair for pair in self.headers)])
        self.read_headers = read_headers
        self.deadlines = Sweeper(_SWEEP_TICK_S)  # the deadlines of waits of _SWEPT_FROM_S and longer

    async def _connect(self, timeout: float, reuse: bool = True) -> _Connection:
        while reuse and self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                conn.reused = True
                return conn
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _HeaderConnection(self, self.read_headers) if self.read_headers else _Connection(self),
                    self.host, self.port)
        except TimeoutError:
            raise UpstreamTimeout("connecting", timeout) from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        return conn

    def _release(self, conn: _Connection) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: list[tuple[bytes, bytes]] | None = None, *, connect_timeout: float = 5.0,
                      header_timeout: float | None = None) -> Response:
        """Send a request and wait for the response's status and headers (the body streams on).

        A kept-alive connection the upstream closed just before this request (a server closes after an answer
        it could not finish cleanly) fails without a byte back: the request is sent once more on a fresh
        connection, since the upstream never read it. Any other failure is the caller's to judge.
        """
        head = [method.encode(), b" ", path.encode(), self._fixed_head, b"content-length: %d\r\n" % len(body)]
        for name, value in headers or ():
            head += (name, b": ", value, b"\r\n")
        head += (b"\r\n", body)
        message = b"".join(head)
        conn = await self._connect(connect_timeout)
        while True:  # the exchange inline, not in a coroutine of its own: one fewer on the path of every wait
            response = Response(conn)
            conn.response = response
            conn.received = False
            conn.transport.write(message)
            try:
                await response.headers(header_timeout)
                return response
            except UpstreamError:
                if not conn.reused or conn.received:
                    raise
            conn = await self._connect(connect_timeout, reuse=False)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


class HttpClient:
    """Pools by upstream; `headers` go with every request (e.g. the upstreams' API key)."""

    def __init__(self, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self._pools: dict[tuple[str, int, frozenset[bytes]], HttpPool] = {}
        self.headers = headers or []

    def pool(self, host: str, port: int, read_headers: frozenset[bytes] = frozenset()) -> HttpPool:
        pool = self._pools.get((host, port, read_headers))
        if pool is None:
            pool = self._pools[(host, port, read_headers)] = HttpPool(host, port, headers=self.headers,
                                                                      read_headers=read_headers)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
