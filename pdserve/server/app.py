"""The instance's HTTP server: vLLM's OpenAI routes plus /health and /metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from pdserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestTimeoutError
from pdserve.ids import clean_request_id, new_external_request_id
from pdserve.migration.wire import MOVED_STATUS, SPLICE_HEADER, MovedOn
from pdserve.net.body import DEFAULT_MAX_BODY_BYTES, BodyTooLarge, read_body
from pdserve.net.front import STATE_KEY, Front
from pdserve.net.json_body import BodyError, decode_object
from pdserve.server.errors import OpenAIError, error_body
from pdserve.server.metrics import ServerMetrics
from pdserve.server.openapi import describe_request_bodies
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.server.serving import OpenAIServing
from pdserve.telemetry.timeline import Origin

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()
SPLICE = SPLICE_HEADER.decode()


class ClientDisconnected(Exception):
    pass


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json", headers=headers)


def error_response(exc: OpenAIError, headers: dict[str, str] | None = None) -> Response:
    return json_response(exc.body(), exc.status, headers)


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int,
                     precheck: Callable[[dict], None] | None = None) -> BaseModel:
    try:
        raw = await read_body(request.scope, request.receive, max_bytes)
    except BodyTooLarge as exc:
        raise OpenAIError(413, str(exc)) from exc
    except ConnectionAbortedError as exc:
        raise ClientDisconnected() from exc
    try:
        data = decode_object(raw)
    except BodyError as exc:
        raise OpenAIError(400, str(exc)) from None
    if precheck is not None:
        precheck(data)  # what can be refused before validation, which is slow for huge bodies
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        # A value that fits no member of a union fails each: name the member whose type it had, if any.
        first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
        where = ".".join(str(p) for p in first.get("loc", ())) or None
        raise OpenAIError(400, f"invalid request: {where}: {first.get('msg')}", _param(first.get("loc", ()))) from exc


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _param(loc: tuple) -> str | None:
    """The field a client can act on: pydantic's location without the union-member tags it adds (list[str]...)."""
    names = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or "-" in p or p in _TYPE_TAGS))]
    return ".".join(names) or None


def external_request_id(request: Request, body_id: str | None = None, minted: str | None = None) -> str:
    # The header was cleaned at the door (pdserve.net.front); an id in the body is cleaned here.
    return request.headers.get("x-request-id") or clean_request_id(body_id) or minted or new_external_request_id()


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it if the client goes away first (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def guard_stream(request: Request, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Stop producing (and so abort the engine requests) as soon as the client disconnects."""
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    iterator = chunks.__aiter__()
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(iterator.__anext__())
            await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                return
            try:
                yield step.result()
            except StopAsyncIteration:
                return
    finally:
        # Whoever noticed the disconnect first (our watcher, or the server cancelling us), the generator may
        # still be running inside `step`: stop it there before closing it, or the engine request never aborts.
        watcher.cancel()
        if step is not None and not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
        await iterator.aclose()


def build_app(engine: AsyncEngine, serving: OpenAIServing, metrics: ServerMetrics,
              extra_routes: Callable[[FastAPI], None] | None = None, log_requests: bool = True,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    app.add_middleware(Front, log_requests=log_requests)
    engine.output_listeners.append(metrics.on_output)
    _add_openai_routes(app, serving, max_body_bytes)
    _add_info_routes(app, engine, serving, metrics)
    _add_error_handlers(app)
    if extra_routes is not None:
        extra_routes(app)
    describe_request_bodies(app, {"/v1/completions": CompletionRequest,
                                  "/v1/chat/completions": ChatCompletionRequest})
    return app


async def openai_route(request: Request, model: type[BaseModel],
                       handler: Callable[[Any, str, dict[str, str]], Awaitable[Any]], max_body_bytes: int,
                       precheck: Callable[[dict], None] | None = None) -> Response:
    """Parse, run until the client leaves, and map every failure to its OpenAI-style error."""
    minted = new_external_request_id()
    headers = {"X-Request-Id": request.headers.get("x-request-id") or minted}  # even a refused body has one
    try:
        body = await parse_body(request, model, max_body_bytes, precheck)
        external_id = external_request_id(request, getattr(body, "request_id", None), minted)
        headers["X-Request-Id"] = external_id
        origin = Origin(external_id, time.time_ns(), request.headers.get("traceparent"),
                        request.scope.get("state", {}).get(STATE_KEY), SPLICE in request.headers)
        result = await until_disconnect(request, handler(body, origin, headers))
    except OpenAIError as exc:
        return error_response(exc, headers)
    except MovedOn as exc:  # the request goes on on another instance: the marker says where
        return Response(exc.body, status_code=MOVED_STATUS, media_type="application/json", headers=headers)
    except ClientDisconnected:
        return Response(status_code=499, headers=headers)
    except EngineDeadError as exc:
        return error_response(OpenAIError(503, str(exc)), headers)
    except RequestTimeoutError as exc:
        return error_response(OpenAIError(504, str(exc)), headers)
    if isinstance(result, dict):
        return json_response(result, headers=headers)
    return StreamingResponse(guard_stream(request, result), media_type="text/event-stream", headers=headers)


def _add_openai_routes(app: FastAPI, serving: OpenAIServing, max_body_bytes: int) -> None:
    limits = getattr(serving, "limits", None)  # an encode instance serves no completions
    precheck = limits.check_unvalidated if limits is not None else None

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai_route(request, CompletionRequest, serving.completions, max_body_bytes, precheck)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai_route(request, ChatCompletionRequest, serving.chat, max_body_bytes)


def _add_info_routes(app: FastAPI, engine: AsyncEngine, serving: OpenAIServing, metrics: ServerMetrics) -> None:
    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [{
            "id": serving.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
            "root": serving.model_name, "max_model_len": serving.max_model_len}]})

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        return json_response(error_body(503, f"engine is not running: {engine.dead}"), 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/timeline/{request_id}")
    async def timeline(request_id: str) -> Response:
        found = serving.timelines.get(request_id)
        if not found:
            return json_response(error_body(404, f"no timeline for request {request_id!r}"), 404)
        return json_response({"object": "list", "data": [t.to_json() for t in found]})

    @app.get("/version")
    async def version() -> Response:
        from importlib.metadata import version as pkg_version

        return json_response({"version": pkg_version("pdserve")})


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(404, f"no route {request.method} {request.url.path}"), 404)

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(405, f"{request.method} is not allowed on {request.url.path}"), 405)
