"""A source's calls to a target instance over HTTP (with the cluster's API key): its status, each copy stage, and
the word that a migration is abandoned. Every call has a deadline."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import msgspec

from pdserve.migration.wire import Abandon, CopyStage, MigrationError, StageReply, TargetStatus, decode_as, encode
from pdserve.net.http_client import HttpClient, HttpPool, UpstreamError, UpstreamTimeout

STATUS_PATH = "/v1/migration"
STAGE_PATH = "/v1/migration/stage"
ABANDON_PATH = "/v1/migration/abandon"
_JSON = [(b"content-type", b"application/json")]


def base_url(url: str) -> tuple[str, str, int]:
    """An instance's URL as (normalised URL, host, port); MigrationError 400 if it is not http://host:port."""
    parts = urlsplit(url.rstrip("/"))
    if parts.scheme != "http" or not parts.hostname or not parts.port or parts.path:
        raise MigrationError(400, f"'to' must be an instance URL like http://host:port, got {url!r}")
    return f"http://{parts.netloc}", parts.hostname, parts.port


class TargetClient:
    def __init__(self, headers: list[tuple[bytes, bytes]], connect_s: float = 3.0, message_s: float = 10.0) -> None:
        self.client = HttpClient(headers)
        self.connect_s = connect_s
        self.message_s = message_s

    def _pool(self, url: str) -> HttpPool:
        _, host, port = base_url(url)
        return self.client.pool(host, port)

    async def _call(self, method: str, url: str, path: str, body: bytes, timeout: float) -> tuple[int, bytes]:
        try:
            response = await self._pool(url).request(method, path, body, _JSON, connect_timeout=self.connect_s,
                                                     header_timeout=timeout)
            return response.status, await response.read(timeout)
        except (UpstreamError, UpstreamTimeout) as exc:
            raise MigrationError(502, f"the target {url} could not be reached: {exc}") from exc

    async def status(self, url: str) -> TargetStatus:
        code, raw = await self._call("GET", url, STATUS_PATH, b"", self.message_s)
        if code == 404:
            raise MigrationError(400, f"{url} takes no migrations (is it a pdserve decode instance?)")
        if code != 200:
            raise MigrationError(502, f"{url} answered {code} about migrations: {_message(raw)}")
        return decode_as(raw, TargetStatus)

    async def stage(self, url: str, stage: CopyStage, timeout: float) -> None:
        code, raw = await self._call("POST", url, STAGE_PATH, encode(stage), timeout)
        if code != 200:
            raise MigrationError(502, f"the target refused the copy ({code}): {_message(raw)}")
        reply = decode_as(raw, StageReply)
        if not reply.ok:
            raise MigrationError(502, f"the target failed the copy: {reply.error}")

    async def abandon(self, url: str, migration_id: str, token: str, reason: str) -> None:
        """Best effort: the target's own deadline frees what it holds if this is lost."""
        try:
            await self._call("POST", url, ABANDON_PATH, encode(Abandon(migration_id=migration_id, token=token,
                                                                        reason=reason)), self.message_s)
        except MigrationError:
            pass

    def close(self) -> None:
        self.client.close()


def _message(raw: bytes) -> str:
    try:
        body: Any = msgspec.json.decode(raw)
        return str(body.get("error", {}).get("message") or body)
    except (msgspec.DecodeError, AttributeError):
        return raw[:200].decode(errors="replace")
