"""Explicit frees of KV a prefill instance holds for a decode that will not happen (never wait for the lease).

pdserve instances take them at POST /v1/kv/release. vLLM has no such endpoint: its NIXL connector frees held
blocks on its own when their lease runs out (`kv_lease_duration` in its kv_connector_extra_config, 30 s by
default). So the gateway does not try on an instance it knows is vLLM, says so once per instance, and counts a
release only when the instance confirmed it; one it could not make is counted apart, with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.registry import Instance
from pdserve.net.http_client import UpstreamError, UpstreamTimeout

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
RELEASE_PATH = "/v1/kv/release"


class KVReleaser:
    def __init__(self, metrics: GatewayMetrics, connect_timeout_s: float, timeout_s: float) -> None:
        self.metrics = metrics
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task] = set()
        self._told: set[str] = set()  # instances whose lack of a release endpoint was logged

    def release(self, instance: Instance, body: dict[str, Any], reason: str) -> None:
        """Fire and forget (with a deadline); `reason` labels the metrics."""
        if instance.caps is not None and not instance.caps.takes_releases:
            self.metrics.kv_releases_not_made.labels(reason, "no_release_endpoint").inc()
            if instance.url not in self._told:
                self._told.add(instance.url)
                log.warning("%s (%s) has no endpoint to free held KV; the gateway leaves it to the instance's own "
                         "lease (vLLM: kv_lease_duration)", instance.url, instance.caps.describe())
            return
        task = asyncio.get_running_loop().create_task(self._send(instance, body, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, instance: Instance, body: dict[str, Any], reason: str) -> None:
        try:
            response = await instance.pool.request("POST", RELEASE_PATH, _encode(body),
                                                   [(b"content-type", b"application/json")],
                                                   connect_timeout=self.connect_timeout_s,
                                                   header_timeout=self.timeout_s)
            await response.read(self.timeout_s)
        except (UpstreamError, UpstreamTimeout) as exc:
            log.warning("could not release KV on %s (%s); its lease will expire", instance.url, exc)
            self.metrics.kv_releases_not_made.labels(reason, "unreachable").inc()
            return
        if response.status == 200:
            self.metrics.kv_releases.labels(reason).inc()
            return
        log.warning("%s answered %d to a KV release; its lease will expire", instance.url, response.status)
        self.metrics.kv_releases_not_made.labels(reason, f"status_{response.status}").inc()

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.timeout_s)
