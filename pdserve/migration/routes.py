"""An instance's migration endpoints (behind its API key, like the OpenAI ones):

* `GET /v1/migration`: whether it takes migrations now, and what its KV is (a source asks before it starts);
* `POST /v1/migration/stage`, `POST /v1/migration/abandon`: a source's copy stages, and its word that it gave up;
* `POST /v1/migrate`: move requests running here to another instance (a gateway's admin call or rebalancer).
"""

from __future__ import annotations

import logging

import msgspec
from fastapi import FastAPI, Request, Response

from pdserve.migration.client import ABANDON_PATH, STAGE_PATH, STATUS_PATH
from pdserve.migration.service import Migrations
from pdserve.migration.wire import Abandon, CopyStage, MigrateRequest, MigrationError, StageReply, decode_as
from pdserve.server.errors import error_body

log = logging.getLogger(__name__)
MIGRATE_PATH = "/v1/migrate"


def _json(body: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def _refused(exc: MigrationError) -> Response:
    return _json(error_body(exc.status, str(exc)), exc.status)


def add_routes(app: FastAPI, migrations: Migrations) -> None:
    @app.get(STATUS_PATH)
    async def status() -> Response:
        return _json(migrations.status())

    @app.post(STAGE_PATH)
    async def stage(request: Request) -> Response:
        try:
            await migrations.target.stage(decode_as(await request.body(), CopyStage))
        except MigrationError as exc:
            return _refused(exc)
        return _json(StageReply(ok=True))

    @app.post(ABANDON_PATH)
    async def abandon(request: Request) -> Response:
        try:
            message = decode_as(await request.body(), Abandon)
        except MigrationError as exc:
            return _refused(exc)
        ended = migrations.source.abandon(message.migration_id, message.token) or await migrations.target.abandon(message)
        return _json({"abandoned": ended})

    @app.post(MIGRATE_PATH)
    async def migrate(request: Request) -> Response:
        try:
            ask = decode_as(await request.body(), MigrateRequest)
            client = request.client
            log.info("migrate %s to %s (mode %s), asked by %s", ask.request_id or f"{ask.count} requests",
                     ask.to or "a target the gateway picks", ask.mode, client.host if client else "?")
            results = await migrations.source.migrate(ask)
        except MigrationError as exc:
            return _refused(exc)
        return _json({"object": "list", "data": results})
