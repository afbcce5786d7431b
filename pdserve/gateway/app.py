"""The gateway's HTTP front: a plain ASGI app (no framework; measured in docs/decisions.md), served by uvicorn."""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import unquote

import msgspec

from pdserve.gateway.service import Gateway
from pdserve.ids import new_external_request_id
from pdserve.net.body import BodyTooLarge, read_body
from pdserve.server.errors import error_body

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
_PROXIED = ("/v1/completions", "/v1/chat/completions")
_TIMELINE = "/v1/timeline/"


async def _respond(send: Any, status: int, body: bytes, content_type: bytes = b"application/json",
                   headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def _error(send: Any, status: int, message: str) -> None:
    await _respond(send, status, _encode(error_body(status, message)))


_SSE_END = b"data: [DONE]\n\n"


class _ResponseTracker:
    """Wraps the ASGI send to know whether the client already has its whole answer: the last body part went
    out, or, for a stream, its [DONE] event did (clients hang up right after it, before the body's end)."""

    def __init__(self, send: Any) -> None:
        self._send = send
        self.complete = False

    async def __call__(self, message: dict) -> None:
        await self._send(message)
        if message["type"] == "http.response.body" and (
                not message.get("more_body", False) or message.get("body", b"").endswith(_SSE_END)):
            self.complete = True


async def _until_disconnect(receive: Any, work: Any, response: _ResponseTracker) -> None:
    """Run the proxying; if the client leaves first, cancel it (which cancels the legs and frees held KV).

    The server reports a disconnect as soon as a complete answer went out; the work left then (a leg's last
    bookkeeping) is let finish, so a served request is not counted as cancelled.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not task.done() and not response.complete:
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def build_app(gateway: Gateway) -> Any:
    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path in _PROXIED:
            if method != "POST":
                await _error(send, 405, f"{method} is not allowed on {path}")
                return
            await _proxy(gateway, scope, receive, send, path)
        elif path == "/health":
            if gateway.ready:
                await _respond(send, 200, b"")
            else:
                await _error(send, 503, f"no usable {'/'.join(gateway.forwarder.roles)} instances")
        elif path == "/metrics":
            await _respond(send, 200, gateway.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            await _models(gateway, send)
        elif path in ("/register", "/deregister") and method == "POST":
            await _membership(gateway, scope, receive, send, path)
        elif path.startswith(_TIMELINE) and method == "GET":
            await _timeline(gateway, send, path[len(_TIMELINE):])
        elif path == "/instances":
            await _respond(send, 200, _encode([{"url": i.url, "role": i.role, "healthy": i.healthy,
                                                "in_flight": i.in_flight, "load": i.load}
                                               for i in gateway.registry.instances.values()]))
        else:
            await _error(send, 404, f"no route {method} {path}")

    return app


async def _proxy(gateway: Gateway, scope: dict, receive: Any, send: Any, path: str) -> None:
    try:
        raw = await read_body(scope, receive, gateway.config.max_request_body_bytes)
    except ConnectionAbortedError:
        return
    except BodyTooLarge as exc:
        await _error(send, 413, str(exc))
        return
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        await _error(send, 400, f"malformed JSON body: {exc}")
        return
    if not isinstance(body, dict):
        await _error(send, 400, "the request body must be a JSON object")
        return
    if "kv_transfer_params" in body and not gateway.config.allow_client_kv_params:
        del body["kv_transfer_params"]  # only the gateway decides where KV comes from
    request_id = _header(scope, b"x-request-id") or new_external_request_id()
    response = _ResponseTracker(send)
    work = gateway.handle(path, body, request_id, response, _header(scope, b"traceparent"))
    await _until_disconnect(receive, work, response)


async def _timeline(gateway: Gateway, send: Any, request_id: str) -> None:
    found = gateway.timelines.get(unquote(request_id))
    if not found:
        await _error(send, 404, f"no timeline for request {request_id!r}")
        return
    await _respond(send, 200, _encode({"object": "list", "data": [t.to_json() for t in found]}))


async def _models(gateway: Gateway, send: Any) -> None:
    for role in ("both", "decode", "prefill"):
        for instance in gateway.registry.usable(role):
            try:
                response = await instance.pool.request("GET", "/v1/models", connect_timeout=2, header_timeout=5)
                body = await response.read(5)
            except (ConnectionError, TimeoutError):
                continue
            if response.status == 200:
                await _respond(send, 200, body)
                return
    await _error(send, 503, "no instance could list its models")


async def _membership(gateway: Gateway, scope: dict, receive: Any, send: Any, path: str) -> None:
    try:
        data = msgspec.json.decode(await read_body(scope, receive, gateway.config.max_request_body_bytes))
        url = data["url"]
        if path == "/register":
            instance = gateway.registry.add(url, data.get("role", "both"))
            await gateway.registry.probe_all()
            await _respond(send, 200, _encode({"url": instance.url, "role": instance.role,
                                               "healthy": instance.healthy}))
        else:
            removed = gateway.registry.remove(url)
            await _respond(send, 200 if removed else 404, _encode({"url": url, "removed": removed}))
    except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
        await _error(send, 400, f"expected {{\"url\": ..., \"role\": ...}}: {exc}")
    except BodyTooLarge as exc:
        await _error(send, 413, str(exc))
    except ConnectionAbortedError:
        return


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
