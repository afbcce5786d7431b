"""Who asks a request to move, at the gateway: an operator (`POST /admin/migrate`, behind the admin token) and,
with `--rebalance`, the gateway itself when one decode instance's KV use or queue exceeds another's by a margin.

Either way the request's source is asked (`POST /v1/migrate`); it checks the target and moves the request, and
whichever gateway relays the request splices its stream (splice.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from prometheus_client import Counter

from pdserve.gateway.registry import Instance
from pdserve.migration.client import base_url
from pdserve.migration.splice import takes_migrations
from pdserve.migration.wire import MODES, MigrateRequest, MigrationError, decode_as, encode
from pdserve.net.http_client import UpstreamError, UpstreamTimeout
from pdserve.server.errors import error_body
from pdserve.utils import pace_bytes_per_s

log = logging.getLogger(__name__)
ADMIN_PATH = "/admin/migrate"
MIGRATE_PATH = "/v1/migrate"
_DECODE_LEGS = ("decode", "decode_window", "colocated")
_MIGRATE_TIMEOUT_S = 120.0  # a source answers once the move is done (or failed)


def serving_instance(gateway: Any, request_id: str) -> Instance:
    """The instance a live request of this gateway runs on: its latest decode leg, from the request's timeline."""
    for timeline in reversed(gateway.timelines.get(request_id)):
        events = list(timeline.events)
        if any(name == "finish" for name, _, _ in events):
            continue
        for name, _, attrs in reversed(events):
            if name == "leg_start" and attrs.get("leg") in _DECODE_LEGS:
                instance = gateway.registry.instances.get(attrs.get("url"))
                if instance is not None:
                    return instance
    raise MigrationError(404, f"no request {request_id!r} is being served through this gateway")


async def ask_source(source: Instance, ask: MigrateRequest) -> tuple[int, Any]:
    try:
        response = await source.pool.request("POST", MIGRATE_PATH, encode(ask), [(b"content-type", b"application/json")],
                                             connect_timeout=3.0, header_timeout=_MIGRATE_TIMEOUT_S)
        raw = await response.read(_MIGRATE_TIMEOUT_S)
    except (UpstreamError, UpstreamTimeout) as exc:
        raise MigrationError(502, f"the source {source.url} could not be asked: {exc}") from exc
    try:
        return response.status, msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return 502, error_body(502, f"the source {source.url} answered {response.status}: {raw[:200]!r}")


async def admin_migrate(gateway: Any, raw: bytes) -> tuple[int, Any]:
    """`POST /admin/migrate {"request_id", "to"[, "mode"]}`: move a live request to the decode instance `to`."""
    try:
        ask = decode_as(raw, MigrateRequest)
        if not ask.request_id or not ask.to:
            raise MigrationError(400, 'expected {"request_id": ..., "to": "http://host:port"}')
        if ask.mode not in MODES:
            raise MigrationError(400, f"mode must be one of {', '.join(MODES)}, got {ask.mode!r}")
        source = serving_instance(gateway, ask.request_id)
        ask.to = _target(gateway, ask.to, source).url
        log.info("admin: moving request %s from %s to %s (%s)", ask.request_id, source.url, ask.to, ask.mode)
        return await ask_source(source, ask)
    except MigrationError as exc:
        return exc.status, error_body(exc.status, str(exc))


def _target(gateway: Any, url: str, source: Instance) -> Instance:
    url, _, _ = base_url(url)
    target = gateway.registry.instances.get(url)
    if target is None:
        raise MigrationError(404, f"{url} is not an instance of this gateway")
    if target.role != "decode":
        raise MigrationError(400, f"{url} is not a decode instance (it is registered as {target.role})")
    if target is source:
        raise MigrationError(400, f"request runs on {url} already")
    if target.draining:
        raise MigrationError(409, f"{url} is draining: it takes no requests")
    if not target.healthy:
        raise MigrationError(409, f"{url} is not healthy")
    return target


class Rebalancer:
    """Every `interval_s`: the decode instance whose KV use (or queue) most exceeds the least loaded one's by the
    margin moves one request there. Load is what the registry scrapes from each instance's /metrics."""

    def __init__(self, gateway: Any, margin: float, queue_margin: float, max_mib_per_s: float,
                 interval_s: float = 1.0) -> None:
        pace_bytes_per_s(max_mib_per_s, "rebalance_max_mib_per_s")  # refused at startup, not at the first move
        self.gateway = gateway
        self.margin = margin
        self.queue_margin = queue_margin
        self.max_mib_per_s = max_mib_per_s
        self.interval_s = interval_s
        self.moves = Counter("pdserve:gateway_rebalance_moves", "Requests the rebalancer asked to move, by outcome.",
                             ["outcome"], registry=gateway.metrics.prom)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            pair = self.pick()
            if pair is not None:
                await self._move(*pair)

    def pick(self) -> tuple[Instance, Instance] | None:
        decodes = [i for i in self.gateway.registry.usable("decode") if takes_migrations(i)]
        if len(decodes) < 2:
            return None
        busiest = max(decodes, key=lambda i: (i.kv_usage, i.waiting))
        idlest = min(decodes, key=lambda i: (i.kv_usage, i.waiting))
        if busiest is idlest or not takes_migrations(idlest, busiest):
            return None
        if busiest.kv_usage - idlest.kv_usage > self.margin or busiest.waiting - idlest.waiting > self.queue_margin:
            return busiest, idlest
        return None

    async def _move(self, source: Instance, target: Instance) -> None:
        # At most half the KV gap moves (so the target cannot end up the busier, and the next round move it back),
        # unless the source has a queue and the target none: then freeing any running request lets one in.
        queued = source.waiting - target.waiting > self.queue_margin and target.waiting == 0
        share = 1.0 if queued else max(source.kv_usage - target.kv_usage, 0.0) / 2
        try:
            status, answer = await ask_source(source, MigrateRequest(to=target.url, count=1, max_share=share,
                                                                         max_mib_per_s=self.max_mib_per_s))
        except MigrationError as exc:
            status, answer = exc.status, None
        outcomes = [r.get("outcome", "?") for r in answer.get("data", [])] if status == 200 else [f"status_{status}"]
        for outcome in outcomes or ["nothing_to_move"]:
            self.moves.labels(outcome).inc()
        log.log(logging.INFO if outcomes else logging.DEBUG, "rebalance: %s (KV %.2f, waiting %g) -> %s (KV %.2f, "
                "waiting %g): %s", source.url, source.kv_usage, source.waiting, target.url, target.kv_usage,
                target.waiting, ", ".join(outcomes) or "nothing to move")
