"""The gateway: registry, selection policy, protocol, retries and the explicit release of held KV."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdserve.gateway.call import Call, Deadlines, LegError, Stage
from pdserve.gateway.conditional import ConditionalDisagg
from pdserve.gateway.encode import EncodeFanout
from pdserve.gateway.forwarders import make_forwarder
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.policies import NoInstanceError, make_policy
from pdserve.gateway.registry import Instance, Registry
from pdserve.ids import TransferId
from pdserve.net.body import DEFAULT_MAX_BODY_BYTES
from pdserve.net.http_client import HttpClient, UpstreamError, UpstreamTimeout
from pdserve.server.errors import error_body
from pdserve.telemetry.timeline import TimelineStore
from pdserve.telemetry.tracing import make_exporter

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode


@dataclass
class GatewayConfig:
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    both: list[str] = field(default_factory=list)
    encode: list[str] = field(default_factory=list)
    protocol: str = "pull"
    scheduling: str = "batch"
    policy: str = "least_loaded"
    retries: int = 1
    deadlines: Deadlines = field(default_factory=Deadlines)
    allow_client_kv_params: bool = False
    conditional: bool = False
    min_prompt_tokens: int = 0
    prefix_threshold: float = 0.8
    tokenizer: str | None = None
    probe_interval_s: float = 1.0
    scrape_interval_s: float = 0.2
    release_timeout_s: float = 5.0
    otlp_traces_endpoint: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.forwarder = make_forwarder(config.protocol, config.scheduling)  # fails fast on a bad combination
        self.policies = {role: make_policy(config.policy) for role in ("prefill", "decode", "both", "encode")}
        self.scheduling = config.scheduling
        self.deadlines = config.deadlines
        self.client = HttpClient()
        self.registry = Registry(self.client, config.probe_interval_s, config.scrape_interval_s,
                                 fetch_kv_info=self.forwarder.needs_kv_info)
        self.metrics = GatewayMetrics(self.registry, config.protocol)
        self.conditional = ConditionalDisagg(self.metrics, config.conditional, config.min_prompt_tokens,
                                             config.prefix_threshold, config.tokenizer)
        self._background: set[asyncio.Task] = set()
        for role in ("prefill", "decode", "both", "encode"):
            for url in getattr(config, role):
                self.registry.add(url, role)
        self.encoder = EncodeFanout(self)
        self.tracing = make_exporter(config.otlp_traces_endpoint, "pdserve-gateway")
        self.timelines = TimelineStore(self.tracing)

    async def start(self) -> None:
        await self.registry.probe_all()
        self.registry.start()

    async def stop(self) -> None:
        await self.registry.stop()
        if self._background:
            await asyncio.wait(self._background, timeout=self.config.release_timeout_s)
        self.client.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    @property
    def ready(self) -> bool:
        return self.registry.has_route(self.forwarder.roles)

    # -- selection ------------------------------------------------------------------------------------------
    def pick(self, role: str, excluded: set[str], affinity: bytes) -> Instance:
        usable = self.registry.usable(role)
        candidates = [i for i in usable if i.url not in excluded] or usable
        if not candidates:
            raise NoInstanceError(f"no healthy {role} instance")
        return self.policies[role].pick(candidates, affinity)

    # -- explicit release of held KV ------------------------------------------------------------------------
    def release_kv(self, instance: Instance, params: dict[str, Any], transfer_id: TransferId) -> None:
        """Tell P to free the KV it holds for a decode that will not happen (never wait for the lease)."""
        self.metrics.kv_releases.labels("decode_not_admitted").inc()
        task = asyncio.get_running_loop().create_task(self._release(instance, params, transfer_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, instance: Instance, params: dict[str, Any], transfer_id: TransferId) -> None:
        body = _encode({**params, "transfer_id": params.get("transfer_id", transfer_id)})
        try:
            response = await instance.pool.request("POST", "/v1/kv/release", body,
                                                   [(b"content-type", b"application/json")],
                                                   connect_timeout=self.deadlines.connect_s,
                                                   header_timeout=self.config.release_timeout_s)
            await response.read(self.config.release_timeout_s)
        except (UpstreamError, UpstreamTimeout) as exc:
            log.warning("could not release KV on %s (%s); its lease will expire", instance.url, exc)

    def release_transfer(self, instance: Instance, transfer_id: TransferId) -> None:
        """P may have finished and held KV that nobody will read: free it by the transfer_id we minted."""
        self.metrics.kv_releases.labels("prefill_abandoned").inc()
        task = asyncio.get_running_loop().create_task(self._release(instance, {"transfer_id": transfer_id}, transfer_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- one client request ---------------------------------------------------------------------------------
    async def handle(self, path: str, body: dict[str, Any], request_id: str, send: Any,
                     traceparent: str | None = None) -> None:
        timeline = self.timelines.start(request_id, "gateway", traceparent=traceparent)
        call = Call(self, path, body, request_id, send, stream=bool(body.get("stream")), timeline=timeline)
        outcome = "error"
        try:
            await self.encoder.prepare(call)
            outcome = await self._attempts(call)
        except asyncio.CancelledError:
            self.metrics.cancellations.labels(call.stage.value).inc()
            self._abandon(call)
            outcome = "cancelled"
            raise
        finally:
            call.end_attempt()
            self.metrics.request_done(outcome, time.monotonic() - call.started, call.timings)
            timeline.finish(outcome=outcome)

    async def _attempts(self, call: Call) -> str:
        for attempt in range(self.config.retries + 1):
            call.new_attempt()
            try:
                await self.forwarder.run(call)
                return "ok"
            except NoInstanceError as exc:
                await self._fail(call, 503, error_body(503, str(exc)))
                return "no_instance"
            except LegError as exc:
                self.metrics.failures.labels(exc.leg, exc.reason).inc()
                self._abandon(call)
                if exc.instance is not None:
                    call.excluded.add(exc.instance.url)
                if exc.retryable and not call.first_byte_sent and attempt < self.config.retries:
                    self.metrics.retries.labels(exc.leg, exc.reason).inc()
                    log.info("request %s: %s; retrying on another pair", call.request_id, exc)
                    continue
                await self._fail(call, exc.status, _body_of(exc))
                return f"{exc.leg}_failed"
        return "error"

    def _abandon(self, call: Call) -> None:
        """End this attempt's legs; if P was prefilling, make sure nothing it may have held stays held."""
        prefill = call.picks.get("prefill")
        if call.stage == Stage.PREFILL_SENT and prefill is not None:
            self.release_transfer(prefill, call.transfer_id)
        call.end_attempt()

    async def _fail(self, call: Call, status: int, body: bytes | dict) -> None:
        payload = body if isinstance(body, bytes) else _encode(body)
        if call.first_byte_sent:
            # Too late for a status code: an error event the client can parse, then the end of the stream.
            if not payload.startswith(b'{"error"'):
                payload = _encode(error_body(status, payload.decode(errors="replace")))
            await call.write(b"data: " + payload + b"\n\ndata: [DONE]\n\n")
            await call.finish()
            return
        await call.respond_json(status, payload)


def _body_of(exc: LegError) -> bytes | dict:
    if exc.body and exc.body.startswith(b"{"):
        return exc.body  # the instance's own OpenAI error (e.g. a 400 about the prompt) is the clearest answer
    return error_body(exc.status, str(exc))
