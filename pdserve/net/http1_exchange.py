"""One request and its response on pdserve's HTTP/1.1 server (pdserve.net.http1): the ASGI `receive` and `send`.

The response's head is held back until its first body part, so that a whole answer (the common case: a JSON body
in one message) goes out in one write with its Content-Length, and a streamed one as chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

log = logging.getLogger("pdserve.server")
STATUS_LINES = {int(s): f"HTTP/1.1 {int(s)} {s.phrase}\r\n".encode() for s in HTTPStatus}
_NO_BODY = (204, 304)
_FRAMING = frozenset((b"content-length", b"transfer-encoding", b"connection"))


class Clock:
    """The Date header, formatted once a second rather than once a response."""

    __slots__ = ("second", "header")

    def __init__(self) -> None:
        self.second, self.header = -1, b""

    def date(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second, self.header = now, f"date: {formatdate(now, usegmt=True)}\r\n".encode()
        return self.header


class Exchange:
    """One request and its response: the ASGI `receive` and `send` of one app call."""

    __slots__ = ("conn", "scope", "keep_alive", "expect_continue", "body", "more_body", "body_taken", "waiter",
                 "disconnected", "complete", "head", "status", "length", "chunked", "bodiless")

    def __init__(self, conn: Any, scope: dict, keep_alive: bool, expect_continue: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.body = bytearray()
        self.more_body = True
        self.body_taken = False  # the app has had the last part of the body
        self.waiter: asyncio.Future | None = None
        self.disconnected = False
        self.complete = False
        self.head: list[bytes] | None = None  # status line and headers, written with the first body part
        self.status = 0
        self.length: int | None = None  # what a declared Content-Length leaves to send
        self.chunked = False
        self.bodiless = scope["method"] == "HEAD"

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def lost(self) -> None:
        if not self.complete:
            self.disconnected = True
        self.wake()

    async def _wait(self) -> None:
        self.waiter = self.conn.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    async def run(self, app: Any) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:
            if not self.complete:
                self.conn.transport.close()
            raise
        except Exception:  # noqa: BLE001 - the server's last word on an app's failure
            log.exception("exception in the ASGI application on %s %s", self.scope["method"], self.scope["path"])
            self._abort()
        else:
            if not self.complete and not self.disconnected:
                log.error("the ASGI application returned without %s its response on %s %s",
                          "completing" if self.status else "starting",
                          self.scope["method"], self.scope["path"])
                self._abort()

    def _abort(self) -> None:
        if (not self.status or self.head is not None) and not self.disconnected:  # nothing written yet
            self.conn.current = None
            self.conn.refuse(500, "Internal Server Error")
        else:
            self.conn.transport.close()

    async def receive(self) -> dict:
        if self.expect_continue:
            self.expect_continue = False
            if not self.conn.transport.is_closing():
                self.conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if not self.body_taken:
            while not (self.disconnected or self.complete or self.body or not self.more_body):
                self.conn.resume_reading()
                await self._wait()
            if not (self.disconnected or self.complete):
                body, self.body = bytes(self.body), bytearray()
                self.body_taken = not self.more_body
                self.conn.resume_reading()
                return {"type": "http.request", "body": body, "more_body": self.more_body}
        # The whole body was handed over: what is left to tell is the client leaving, or the answer having gone.
        while not (self.disconnected or self.complete):
            await self._wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        conn = self.conn
        if conn.drained is not None and not conn.drained.done() and not self.disconnected:
            await conn.drained
        if self.disconnected:
            return
        kind = message["type"]
        if not self.status:
            if kind != "http.response.start":
                raise RuntimeError(f"expected http.response.start, got {kind}")
            self._start(message)
        elif self.complete or kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind} after the response "
                               f"{'completed' if self.complete else 'started'}")
        else:
            self._body(message.get("body", b""), message.get("more_body", False))

    def _start(self, message: dict) -> None:
        status = message["status"]
        self.expect_continue = False
        lines = [STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status, self.conn.server.clock.date()]
        for name, value in message.get("headers", ()):
            lowered = name.lower()
            if lowered in _FRAMING:
                if lowered == b"content-length":
                    self.length = int(value)
                elif lowered == b"transfer-encoding":
                    self.chunked = value.lower() == b"chunked"
                elif value.lower().find(b"close") >= 0:  # connection: written below, once, from keep_alive
                    self.keep_alive = False
                    continue
            lines += (name, b": ", value, b"\r\n")
        head = b"".join(lines)
        # A CR or LF inside a name or value would end its line early, so a good head has exactly one of each per
        # line: two counts in C rather than a search per header, and a name with a colon would split itself.
        # (Not `b":" in name`: CPython's `bytes in bytes` first tries the operand as an int, and the TypeError it
        # raises and clears costs more than the rest of the header's work.)
        count = len(lines) // 4 + 2  # the status line, the date and each header
        if head.count(b"\n") != count or head.count(b"\r") != count or b"".join(lines[2::4]).find(b":") >= 0:
            raise RuntimeError(f"invalid response header in {message.get('headers')!r:.300}")
        if status in _NO_BODY or status < 200:
            self.bodiless = True
        self.status, self.head = status, [head]  # started only once its head is known to be good

    def _body(self, body: bytes, more: bool) -> None:
        out = self.head
        if out is not None:
            self.head = None
            if self.length is None and not self.chunked and self.status not in _NO_BODY and self.status >= 200:
                if more:
                    self.chunked = True
                    out.append(b"transfer-encoding: chunked\r\n")
                else:
                    self.length = len(body)
                    out.append(b"content-length: %d\r\n" % len(body))
            if not self.keep_alive:
                out.append(b"connection: close\r\n")
            out.append(b"\r\n")
        else:
            out = []
        if self.bodiless:
            pass
        elif self.chunked:
            if body:
                out += (b"%x\r\n" % len(body), body, b"\r\n")
            if not more:
                out.append(b"0\r\n\r\n")
        else:
            if self.length is not None:
                self.length -= len(body)
                if self.length < 0:
                    raise RuntimeError("response body longer than its Content-Length")
            out.append(body)
        if out:
            self.conn.transport.write(b"".join(out))
        if not more:
            if self.length and not self.bodiless:
                raise RuntimeError("response body shorter than its Content-Length")
            self.complete = True
            self.wake()
            self.conn.answered(self)
