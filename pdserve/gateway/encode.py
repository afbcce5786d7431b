"""E→P→D (and E→PD): images go to encode instances before the usual PD protocol runs.

Each image part gets a `uuid` (a hash of its URL, unless the client named it), so every instance derives the
same mm_hash without re-hashing pixels. Images seen before are not encoded again: the gateway remembers where
their output is. New ones are spread over the encode instances and encoded in parallel; the returned
`ec_transfer_params` join the request, and P (or PD) loads them. An encode failure costs only time: P then
encodes locally (optimistic scheduling with rollback).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from typing import Any

import msgspec

from pdserve.gateway.policies import NoInstanceError
from pdserve.net.http_client import UpstreamError, UpstreamTimeout

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
IMAGE_TYPES = ("image_url", "image")


def client_messages(body: dict[str, Any]) -> list[Any]:
    """The body's messages if they are a list (the instance refuses anything else with a 400)."""
    messages = body.get("messages")
    return messages if isinstance(messages, list) else []


def image_parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    parts = []
    for message in client_messages(body):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts.extend(p for p in content if isinstance(p, dict) and p.get("type") in IMAGE_TYPES)
    return parts


def part_uuid(part: dict[str, Any]) -> str:
    if part.get("uuid"):
        return str(part["uuid"])
    spec = part.get("image_url") or {}
    url = spec.get("url", "") if isinstance(spec, dict) else str(spec)
    return hashlib.sha256(url.encode()).hexdigest()


class EncodeFanout:
    def __init__(self, gateway: Any, capacity: int = 10_000) -> None:
        self.gateway = gateway
        self.capacity = capacity
        self.known: OrderedDict[str, tuple[str, dict[str, Any]]] = OrderedDict()  # uuid -> (mm_hash, ec params)

    async def prepare(self, call: Any) -> None:
        """Encode what is new, reuse what is known; add ec_transfer_params to the request body."""
        parts = image_parts(call.body)
        if not parts or not self.gateway.registry.usable("encode"):
            return
        for part in parts:
            part["uuid"] = part_uuid(part)
        params: dict[str, Any] = {}
        todo: list[dict[str, Any]] = []
        metrics = self.gateway.metrics
        for part in parts:
            known = self.known.get(part["uuid"])
            if known is not None:
                self.known.move_to_end(part["uuid"])
                params[known[0]] = known[1]
                metrics.child(metrics.encode_items, "cache_hit").inc()
            elif part["uuid"] not in {p["uuid"] for p in todo}:
                todo.append(part)
        results = await asyncio.gather(*(self._encode_one(call, part) for part in todo))
        for part, result in zip(todo, results, strict=True):
            if result is None:
                continue
            mm_hash, item_params = result
            params[mm_hash] = item_params
            self.known[part["uuid"]] = (mm_hash, item_params)
            while len(self.known) > self.capacity:
                self.known.popitem(last=False)
        if params:
            call.body["ec_transfer_params"] = params

    async def _encode_one(self, call: Any, part: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        metrics = self.gateway.metrics
        try:
            instance = self.gateway.pick("encode", set(), b"")
        except NoInstanceError:
            return None
        body = {"model": call.body.get("model"), "messages": [{"role": "user", "content": [part]}]}
        deadlines = self.gateway.deadlines
        headers = [(b"content-type", b"application/json"), (b"x-request-id", call.request_id.encode()),
                   *call.leg_started("encode", instance, key=f"encode:{id(part)}")]
        status = 0
        try:
            response = await instance.pool.request("POST", "/v1/chat/completions", _encode(body), headers,
                                                   connect_timeout=deadlines.connect_s,
                                                   header_timeout=deadlines.prefill_s)
            raw = await response.read(deadlines.prefill_s)
            status = response.status
            if status < 500:
                instance.breaker.alive()
            answer = msgspec.json.decode(raw)
            mm_hash = answer["mm_items"][0]["mm_hash"]
            item_params = answer["ec_transfer_params"][mm_hash]
        except (UpstreamError, UpstreamTimeout, msgspec.DecodeError, KeyError, IndexError, TypeError) as exc:
            if isinstance(exc, (UpstreamError, UpstreamTimeout)):
                self.gateway.registry.report_failure(instance, exc)
            log.warning("encoding on %s failed (%s); the prefill instance will encode locally", instance.url, exc)
            metrics.child(metrics.encode_items, "failed").inc()
            return None
        finally:
            call.leg_ended("encode", instance, status, key=f"encode:{id(part)}")
        if response.status != 200:
            metrics.child(metrics.encode_items, "failed").inc()
            return None
        metrics.child(metrics.encode_items, "encoded").inc()
        return mm_hash, item_params
