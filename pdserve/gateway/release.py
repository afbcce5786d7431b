"""Explicit frees of KV a prefill instance holds for a decode that will not happen (never wait for the lease).

pdserve instances take them at POST /v1/kv/release. vLLM serves no such endpoint, but with pdserve's PdConnector
inside it, its transfer agent takes pdserve's typed Release message on its side channel (named by the info
metric the gateway learned it from), the message a decode instance sends when it gives a transfer up. vLLM's own
NIXL connector takes neither: it frees held blocks on its own when their lease runs out (`kv_lease_duration` in
its kv_connector_extra_config, 30 s by default), so the gateway does not try there and says so once per instance.
A release is counted only when the instance confirmed it; one it could not make is counted apart, with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import zmq.asyncio

from pdserve.gateway.capabilities import RELEASE_SIDE_CHANNEL
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.registry import Instance
from pdserve.kv_transfer.messages import Ack, Release
from pdserve.kv_transfer.params import KVParamsError, parse_release
from pdserve.kv_transfer.side_channel import SideChannelClient, SideChannelError
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
        self._told: set[str] = set()  # instances whose lack of a way to free held KV was logged
        self._zmq: zmq.asyncio.Context | None = None  # made at the first side-channel release

    def release(self, instance: Instance, body: dict[str, Any], reason: str) -> None:
        """Fire and forget (with a deadline); `reason` labels the metrics."""
        caps = instance.caps
        if caps is not None and not caps.releases:
            self.metrics.kv_releases_not_made.labels(reason, "no_release_endpoint").inc()
            if instance.url not in self._told:
                self._told.add(instance.url)
                log.warning("%s (%s) has no endpoint to free held KV; the gateway leaves it to the instance's own "
                         "lease (vLLM: kv_lease_duration)", instance.url, caps.describe())
            return
        over_side_channel = caps is not None and caps.releases == RELEASE_SIDE_CHANNEL
        send = self._send_release_message if over_side_channel else self._send
        task = asyncio.get_running_loop().create_task(send(instance, body, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, instance: Instance, body: dict[str, Any], reason: str) -> None:
        try:
            response = await instance.pool.request("POST", RELEASE_PATH, _encode(body),
                                                   [(b"content-type", b"application/json")],
                                                   connect_timeout=self.connect_timeout_s,
                                                   header_timeout=self.timeout_s)
            answer = await response.read(self.timeout_s)
        except (UpstreamError, UpstreamTimeout) as exc:
            self._not_made(instance, reason, "unreachable", str(exc))
            return
        if response.status == 200 and _released(answer):
            self.metrics.kv_releases.labels(reason).inc()
            return
        if response.status == 200:  # nothing was held under that name any more: read, expired or never held
            self.metrics.kv_releases_not_made.labels(reason, "nothing_held").inc()
            return
        self._not_made(instance, reason, f"status_{response.status}", f"it answered {response.status}")

    async def _send_release_message(self, instance: Instance, body: dict[str, Any], reason: str) -> None:
        """The Release message a consumer sends, on the side channel the instance named. The message names P's
        key and token, as P handed them out; a body with only the gateway's transfer id names neither."""
        try:
            named = parse_release(body)
        except KVParamsError:
            named = None
        if named is None or named.key is None:
            self._not_made(instance, reason, "no_transfer_key", "the gateway never got P's transfer key")
            return
        side = instance.caps.side_channel
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        client = SideChannelClient(self._zmq, side.host, side.port)
        try:
            reply = await client.request(Release(key=named.key, token=named.token, reason=reason), self.timeout_s)
        except SideChannelError as exc:
            self._not_made(instance, reason, "unreachable", str(exc))
            return
        finally:
            client.close()
        if isinstance(reply, Ack) and reply.ok:
            if named.key in reply.unknown_keys:  # nothing was held under that name any more: read, expired, released
                self.metrics.kv_releases_not_made.labels(reason, "nothing_held").inc()
            else:
                self.metrics.kv_releases.labels(reason).inc()
            return
        refusal = reply.error if isinstance(reply, Ack) else f"it answered {type(reply).__name__}"
        self._not_made(instance, reason, "refused", refusal)

    def _not_made(self, instance: Instance, reason: str, why: str, detail: str) -> None:
        log.warning("could not release KV on %s (%s); its lease will expire", instance.url, detail)
        self.metrics.kv_releases_not_made.labels(reason, why).inc()

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.timeout_s)
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None


def _released(answer: bytes) -> bool:
    """A pdserve instance answers {"released": bool}; any other 200 body is taken as done."""
    try:
        body = msgspec.json.decode(answer)
    except msgspec.DecodeError:
        return True
    return not isinstance(body, dict) or body.get("released") is not False
