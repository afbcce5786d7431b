"""A small etcd v3 client over etcd's JSON gateway (`/v3/...`), on aiohttp.

Chosen by measurement over aetcd and etcd3aio (docs/decisions.md): membership needs six calls (range, put,
delete, lease grant / keep-alive / revoke, and a prefix watch), it must fail over between the members of a
cluster, and it must recover from an etcd that went away without the process restarting. The gRPC clients pull
grpcio and its threads into the gateway, and aetcd talks to one endpoint only. Every call has a deadline; a call
that cannot reach a member tries the next one, and raises EtcdUnavailable when none answered.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

log = logging.getLogger(__name__)


class EtcdError(Exception):
    """etcd answered, and refused (a bad request, a compacted revision)."""


class EtcdUnavailable(EtcdError):
    """No member of the cluster answered in time."""


class WatchCompacted(EtcdError):
    """The watch's start revision was compacted away: relist, then watch from the list's revision."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's range_end for a prefix)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    kv: KeyValue
    prev: KeyValue | None  # the value before a delete (the record that left), when etcd still had it


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(base64.b64decode(raw.get("key", "")), base64.b64decode(raw.get("value", "")),
                    int(raw.get("mod_revision", 0)), int(raw.get("lease", 0)))


class EtcdClient:
    """One client per process; `endpoints` are `host:port` of the cluster's members."""

    def __init__(self, endpoints: list[str], timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._current = 0  # the member that answered last: tried first
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST one request to the first member that answers; EtcdUnavailable when none does in time."""
        failures = []
        for i in range(len(self.endpoints)):
            index = (self._current + i) % len(self.endpoints)
            endpoint = self.endpoints[index]
            try:
                async with asyncio.timeout(self.timeout_s):
                    async with self._http().post(f"http://{endpoint}{path}", json=body) as answer:
                        data = await answer.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                failures.append(f"{endpoint}: {str(exc) or type(exc).__name__}")
                continue
            if answer.status == 503 or (isinstance(data, dict) and _unavailable(data)):
                failures.append(f"{endpoint}: {data.get('message') or data.get('error') or answer.status}")
                continue  # a member without quorum or leader: another may have both
            self._current = index
            if answer.status != 200:
                raise EtcdError(f"etcd {path}: {answer.status} {data.get('message') or data.get('error')}")
            return data
        raise EtcdUnavailable("; ".join(failures))

    # -- keys ----------------------------------------------------------------------------------------------
    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under `prefix` and the store's revision at the time of the read."""
        data = await self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return [_kv(kv) for kv in data.get("kvs", [])], int(data["header"]["revision"])

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        data = await self.call("/v3/kv/put", body)
        return int(data["header"]["revision"])

    async def delete(self, key: bytes) -> int:
        data = await self.call("/v3/kv/deleterange", {"key": _b64(key)})
        return int(data.get("deleted", 0))

    # -- leases --------------------------------------------------------------------------------------------
    async def grant(self, ttl_s: int) -> int:
        data = await self.call("/v3/lease/grant", {"TTL": str(ttl_s)})
        return int(data["ID"])

    async def keep_alive(self, lease: int) -> int:
        """Refresh the lease once; its remaining TTL in seconds, 0 when etcd no longer has it."""
        data = await self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(data.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        try:
            await self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    # -- watch ---------------------------------------------------------------------------------------------
    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        """Batches of changes under `prefix` from `start_revision` on, as etcd sends them, until the stream
        breaks (EtcdUnavailable) or the revision is compacted (WatchCompacted)."""
        request = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                      "start_revision": str(start_revision), "prev_kv": True,
                                      "progress_notify": True}}
        endpoint = self.endpoints[self._current]
        try:
            async with self._http().post(f"http://{endpoint}/v3/watch", data=json.dumps(request)) as answer:
                if answer.status != 200:
                    raise EtcdUnavailable(f"{endpoint}: watch answered {answer.status}")
                async for line in answer.content:
                    events = _watch_events(line)
                    if events is not None:
                        yield events
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            self._current = (self._current + 1) % len(self.endpoints)  # the next try starts elsewhere
            raise EtcdUnavailable(f"{endpoint}: watch stream broke ({str(exc) or type(exc).__name__})") from exc
        self._current = (self._current + 1) % len(self.endpoints)
        raise EtcdUnavailable(f"{endpoint}: watch stream ended")


def _unavailable(data: dict[str, Any]) -> bool:
    message = str(data.get("message") or data.get("error") or "")
    return "no leader" in message or "timed out" in message or "unavailable" in message.lower()


def _watch_events(line: bytes) -> list[WatchEvent] | None:
    line = line.strip()
    if not line:
        return None
    result = json.loads(line).get("result") or {}
    if result.get("compact_revision") and result.get("canceled"):
        raise WatchCompacted(f"revision compacted up to {result['compact_revision']}")
    if result.get("canceled"):
        raise EtcdUnavailable(f"watch canceled: {result.get('cancel_reason', '')}")
    return [WatchEvent("delete" if e.get("type") == "DELETE" else "put", _kv(e.get("kv", {})),
                       _kv(e["prev_kv"]) if e.get("prev_kv") else None) for e in result.get("events", [])]
