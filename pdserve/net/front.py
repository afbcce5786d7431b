"""The outermost layer of every HTTP app (instance and gateway), in plain ASGI.

It gives each request a safe `X-Request-Id` (bounded, no control characters), keeps every response header within
what clients read (pdserve.net.headers), turns an error that escaped the app into one logged traceback and an
OpenAI-style 500 (instead of the server's plain-text 500, a second traceback and a reset connection), and writes
one access-log line per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.ids import clean_request_id
from pdserve.net.headers import bound_headers, over_bound, request_header, set_request_headers

log = logging.getLogger("pdserve.server")
access_log = logging.getLogger("pdserve.access")
_encode = msgspec.json.Encoder().encode
# Polled by load balancers and scrapers every few seconds: not worth a log line each.
_QUIET_PATHS = frozenset({"/health", "/metrics"})
STATE_KEY = "pdserve_access"
_SSE_END = b"data: [DONE]\n\n"


@dataclass(slots=True)
class AccessRecord:
    """What the access log says about one request; a route fills in what only it knows."""

    method: str
    path: str
    started: float
    status: int = 0
    request_id: str = "-"
    usage: Callable[[], dict[str, Any]] | None = None  # token counts, read when the response ended
    # The client has its whole answer: the last body part went out, or, for a stream, its [DONE] event did (clients
    # hang up right after it, before the body's end). A route that watches for the client leaving reads it.
    complete: bool = False

    def line(self) -> str:
        parts = [f"{self.method} {self.path} {self.status} {time.monotonic() - self.started:.3f}s "
                 f"id={self.request_id}"]
        usage = self.usage() if self.usage is not None else None
        if usage:
            parts.append(f"prompt_tokens={usage.get('prompt_tokens')} "
                         f"completion_tokens={usage.get('completion_tokens')}")
        return " ".join(parts)


class Front:
    def __init__(self, app: Any, log_requests: bool = True) -> None:
        self.app = app
        self.log_requests = log_requests

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if request_header(scope, b"x-request-id") is not None:
            set_request_headers(scope, _clean_headers(scope["headers"]))
        record = AccessRecord(scope["method"], scope["path"], time.monotonic())
        scope.setdefault("state", {})[STATE_KEY] = record

        # The one wrapper of the server's send: every response message passes here once, whatever layer reads it.
        # A closure, not a method of the record: the record is in the scope, which the server's send holds, and a
        # record holding that send would make every request a reference cycle left to the garbage collector.
        async def tracking_send(message: dict) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                record.status = message["status"]
                headers = message.get("headers", ())
                request_id = dict(headers).get(b"x-request-id")  # ASGI's header names are lower case
                if request_id is not None:
                    record.request_id = request_id.decode("latin-1")
                if over_bound(headers):
                    message = {**message, "headers": bound_headers(headers)}
            await send(message)
            if kind == "http.response.body" and (
                    not message.get("more_body", False) or message.get("body", b"").endswith(_SSE_END)):
                record.complete = True

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the one place an unexpected error is logged and answered
            log.exception("unexpected error on %s %s", record.method, record.path)
            if not record.status:
                await _internal_error(tracking_send, type(exc).__name__)
        finally:
            # An app that returned without answering saw its client leave (nginx's 499).
            record.status = record.status or 499
            if self.log_requests and record.path not in _QUIET_PATHS and access_log.isEnabledFor(logging.INFO):
                access_log.info("%s", record.line())  # formatted only when it is written


async def _internal_error(send: Any, kind: str) -> None:
    body = _encode({"error": {"message": f"internal server error ({kind}; details in the server's log)",
                              "type": "InternalServerError", "param": None, "code": 500}})
    try:
        await send({"type": "http.response.start", "status": 500,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
    except OSError:  # the client is gone: nobody to tell
        pass


def _clean_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    out = []
    for key, value in headers:
        if key == b"x-request-id":
            cleaned = clean_request_id(value.decode("latin-1"))
            if cleaned is None:
                continue
            value = cleaned.encode()
        out.append((key, value))
    return out
