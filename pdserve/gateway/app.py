"""The gateway's HTTP front: a plain ASGI app (no framework; measured in docs/decisions.md), served by uvicorn."""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import unquote

import msgspec

from pdserve.gateway.admin import ADMIN_PATHS, kind, membership
from pdserve.gateway.service import Gateway
from pdserve.ids import new_external_request_id
from pdserve.net.auth import AccessPolicy, AccessRules, refuse
from pdserve.net.front import STATE_KEY, AccessRecord, Front
from pdserve.net.headers import request_header
from pdserve.net.json_body import BodyError, decode_object
from pdserve.net.sweeper import Sweeper
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


# Most answers are out before this: watching for the client to leave starts only after it (and before twice it:
# the app's sweeper checks every WATCH_AFTER_S), so that a quick request never pays for a watcher task, nor for a
# timer of its own (a client that left sooner is noticed that much later).
WATCH_AFTER_S = 0.05


async def _cancel_on_disconnect(receive: Any, task: asyncio.Task, response: AccessRecord) -> bool:
    """True when it cancelled `task`: the client left before its whole answer went out."""
    while (await receive())["type"] != "http.disconnect":
        pass
    if response.complete:
        return False
    task.cancel()
    return True


def build_app(gateway: Gateway, access: AccessPolicy | None = None, log_requests: bool = True) -> Any:
    """The gateway's routes behind its access rules (by default: no API key, admin endpoints off)."""
    watch = Sweeper(WATCH_AFTER_S)  # when each proxied request starts watching for its client to leave
    rules = AccessRules(access or AccessPolicy(admin_paths=ADMIN_PATHS))

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        refusal = rules.refusal(scope)  # asked here, not by a middleware: a coroutine fewer on every request's path
        if refusal is not None:
            await refuse(send, *refusal)
            return
        path, method = scope["path"], scope["method"]
        if path in _PROXIED:
            if method != "POST":
                await _error(send, 405, f"{method} is not allowed on {path}")
                return
            await _proxy(gateway, scope, receive, send, path, watch)
        elif path == "/health":
            if gateway.ready:
                await _respond(send, 200, b"")
            else:
                await _error(send, 503, gateway.unready_reason())
        elif path == "/metrics":
            await _respond(send, 200, gateway.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            await _models(gateway, send)
        elif path in ADMIN_PATHS and method == "POST":
            await _membership(gateway, scope, receive, send, path)
        elif path.startswith(_TIMELINE) and method == "GET":
            await _timeline(gateway, send, path[len(_TIMELINE):])
        elif path == "/instances":
            await _respond(send, 200, _encode([{"url": i.url, "role": i.role, "healthy": i.healthy,
                                                "in_flight": i.in_flight, "load": i.load, "kind": kind(i)}
                                               for i in gateway.registry.instances.values()]))
        else:
            await _error(send, 404, f"no route {method} {path}")

    return Front(app, log_requests)


async def _proxy(gateway: Gateway, scope: dict, receive: Any, send: Any, path: str, watch: Sweeper) -> None:
    request_id = _header(scope, b"x-request-id") or new_external_request_id()
    record = scope["state"][STATE_KEY]  # Front's: it knows when the whole answer went out (`complete`)
    record.request_id = request_id  # for the access log, even if the body is refused
    try:
        raw = await read_body(scope, receive, gateway.config.max_request_body_bytes)
    except ConnectionAbortedError:
        return
    except BodyTooLarge as exc:
        await _error(send, 413, str(exc))
        return
    try:
        body = decode_object(raw)
    except BodyError as exc:
        await _error(send, 400, str(exc))
        return
    if "kv_transfer_params" in body and not gateway.config.allow_client_kv_params:
        del body["kv_transfer_params"]  # only the gateway decides where KV comes from
    # The proxying runs in the server's own task; a watcher task, started once the request outlived WATCH_AFTER_S,
    # cancels it if the client leaves first (which cancels the legs and frees held KV). The server reports a
    # disconnect as soon as a complete answer went out; the work left then (a leg's last bookkeeping) is let
    # finish, so a served request is not counted as cancelled.
    loop = gateway.loop or asyncio.get_running_loop()
    task = asyncio.current_task(loop)  # given the loop: asking asyncio for it is a system call on Python 3.11
    watchers: list[asyncio.Task] = []
    watch.add(task, WATCH_AFTER_S, lambda _: watchers.append(
        loop.create_task(_cancel_on_disconnect(receive, task, record))), loop)
    try:
        await gateway.handle(path, body, request_id, send, _header(scope, b"traceparent"))
    except asyncio.CancelledError:
        watcher = watchers[0] if watchers else None
        if watcher is None or not (watcher.done() and not watcher.cancelled() and watcher.result()):
            raise  # not the client leaving: the server is stopping
        task.uncancel()
    finally:
        watch.discard(task)
        for watcher in watchers:
            watcher.cancel()


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
        raw = await read_body(scope, receive, gateway.config.max_request_body_bytes)
    except ConnectionAbortedError:
        return
    except BodyTooLarge as exc:
        await _error(send, 413, str(exc))
        return
    status, body = await membership(gateway, scope, raw, path)
    await _respond(send, status, _encode(body))



def _header(scope: dict, name: bytes) -> str | None:
    value = request_header(scope, name)
    return None if value is None else value.decode("latin-1")
