"""One serving instance: engine, its async driver, its connectors, and the HTTP app in front of them."""

from __future__ import annotations

import logging
import os
from importlib.metadata import version as pkg_version
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response

from pdserve.config import EngineConfig
from pdserve.ec_transfer.factory import build_ec_connector
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_events.block_events import StoreEvents
from pdserve.kv_events.config import parse_config
from pdserve.kv_events.publisher import KVEventPublisher
from pdserve.kv_transfer.decode_first import DecodeFirstClient
from pdserve.kv_transfer.factory import DEFAULT_CONNECTOR, build_connectors
from pdserve.kv_transfer.layouts import PDSERVE
from pdserve.membership.drain import DrainState
from pdserve.membership.member import InstanceMember, MemberOptions
from pdserve.membership.record import MemberRecord
from pdserve.migration.routes import add_routes as add_migration_routes
from pdserve.migration.service import Migrations
from pdserve.multimodal.media import MediaPolicy
from pdserve.multimodal.prompt import MultimodalPrompter
from pdserve.net.auth import bearer_header
from pdserve.net.body import DEFAULT_MAX_BODY_BYTES
from pdserve.server.app import build_app, json_response
from pdserve.server.encode_serving import EncodeServing
from pdserve.server.errors import error_body
from pdserve.server.info import INFO_PATH, InstanceInfo, protocols_for
from pdserve.server.metrics import ServerMetrics
from pdserve.server.serving import OpenAIServing
from pdserve.server.workers import WorkerPool
from pdserve.telemetry.timeline import TimelineStore
from pdserve.telemetry.tracing import make_exporter

log = logging.getLogger(__name__)
_ROLE_OF_KV_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode"}
# The exit status of an instance whose engine can no longer be trusted (EX_SOFTWARE): a supervisor restarts it.
ENGINE_FAILED_EXIT = 70


class Instance:
    def __init__(self, config: EngineConfig, request_timeout_s: float = 600.0,
                 otlp_traces_endpoint: str | None = None, log_requests: bool = True,
                 api_key: str | None = None, max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.config = config
        self.log_requests = log_requests
        self.max_request_body_bytes = max_request_body_bytes
        self.tracing = make_exporter(otlp_traces_endpoint, f"pdserve-{self._kv_role()}")
        self.timelines = TimelineStore(self.tracing)
        self.kv_events_config = parse_config(config.kv_events_config)  # a bad one fails before the model loads
        model = config.resolve_model()
        config.check_kv_capacity(model.max_model_len)
        self.connectors = build_connectors(config, model)
        if self.connectors is not None:  # decode-first: D asks P to prefill, with the cluster's API key
            self.connectors.decode_first = DecodeFirstClient(headers=bearer_header(api_key))
        self.ec = build_ec_connector(config.ec_transfer_config)
        self.engine = LLMEngine(config, self.connectors, model, self.ec)
        self.async_engine = AsyncEngine(self.engine, request_timeout_s, on_fatal=_exit_now)
        self.workers = WorkerPool()  # tokenizing and image decoding, off the event loop
        self.kv_events: KVEventPublisher | None = None
        self.api_key = api_key
        self.migrations: Migrations | None = None  # running requests that move between decode instances

    async def start(self, advertised_host: str = "127.0.0.1") -> FastAPI:
        if self.kv_events_config.enabled and self.config.role != "encode":
            tier = self.connectors.store if self.connectors is not None else None
            self.kv_events = KVEventPublisher(self.kv_events_config, advertised_host, self.config.block_size,
                                              tier.identity if tier is not None else None)
            self.engine.publish_kv_events(self.kv_events)  # before the engine thread runs a step
            if tier is not None:  # what the shared store took goes out as "STORAGE" blocks
                tier.on_stored.append(StoreEvents(self.kv_events, tier.namespace.block_size,
                                                  tier.namespace.root()).stored)
        self.async_engine.start()
        bundle = self.connectors
        if bundle is not None:
            await bundle.start(self.async_engine, advertised_host)
            if self.config.role in ("decode", "both"):
                self.migrations = Migrations(self.async_engine, bundle, self.engine.tokenizer, self._kv_role(),
                                             self.config.model_name, self.timelines, bearer_header(self.api_key))
                self.migrations.start()
        if self.ec is not None and self._ec_produces():
            self.ec.start()
        serving = self._serving()
        metrics = ServerMetrics(self.config.model_name, self.engine.stats, self._extra_metrics(serving))
        return build_app(self.async_engine, serving, metrics, self._extra_routes, self.log_requests,
                         self.max_request_body_bytes)

    def _extra_routes(self, app: FastAPI) -> None:
        info = self.info()

        @app.get(INFO_PATH)
        async def pdserve_info() -> Response:
            """What this instance is and which PD protocols it takes part in (a gateway reads it on each probe)."""
            return Response(msgspec.json.encode(info), media_type="application/json")

        if self.connectors is not None:
            self._transfer_routes(app)
        if self.migrations is not None:
            add_migration_routes(app, self.migrations)

    def info(self) -> InstanceInfo:
        bundle = self.connectors
        connector = (self.config.kv_transfer_config.get("kv_connector") or DEFAULT_CONNECTOR) if bundle else None
        return InstanceInfo(
            engine_version=pkg_version("pdserve"), role=self.config.role, kv_connector=connector,
            data_planes=sorted(bundle.planes) if bundle else [], protocols=protocols_for(self.config.role, connector),
            engine_id=bundle.engine_id if bundle else None,
            side_channel_host=bundle.agent.config.host if bundle else None,
            side_channel_port=bundle.agent.port if bundle else None,
            kv_sources=bundle.kv_sources() if bundle else [],
            kv_sinks=["vllm-nixl"] if bundle and bundle.agent.vllm_producer is not None else [],
            kv_layout=PDSERVE if bundle else None, kv_block_size=self.config.block_size if bundle else None,
            kv_events=self.kv_events.address() if self.kv_events is not None else None)

    def member(self, options: MemberOptions) -> InstanceMember:
        """This instance's registration (when options name a store) and drain."""
        info = self.info()
        record = MemberRecord(url=options.advertise_url, role=self._kv_role(), model=self.config.model_name,
                              info=info, labels=options.labels, source="self")
        bundle, engine = self.connectors, self.engine
        state = DrainState(bundle.held_for_others if bundle else (lambda: 0),
                           bundle.release_all_held if bundle else (lambda: 0), lambda: engine.kv.num_used_blocks)
        if self.migrations is None:
            return InstanceMember(options, lambda: record, state)
        # A decode instance moves its running requests to other decode instances (those that cannot move finish).
        return InstanceMember(options, lambda: record, state, hand_off=self.migrations.hand_off)

    def _ec_produces(self) -> bool:
        return self.config.role == "encode" or self.config.ec_transfer_config.get("ec_role") in ("ec_producer",
                                                                                                 "ec_both")

    def _serving(self) -> OpenAIServing | EncodeServing:
        prompter = self._prompter()
        if self.config.role == "encode":
            if prompter is None or self.ec is None:
                raise ValueError("an encode instance needs a multimodal model and --ec-transfer-config")
            return EncodeServing(self.async_engine, self.config.model_name, prompter, self.ec, self.timelines,
                                 self.workers)
        bundle = self.connectors
        return OpenAIServing(
            self.async_engine, self.config.model_name, self.engine.tokenizer, self.engine.max_model_len,
            kv_params=bundle, prompter=prompter, role=self._kv_role(), timelines=self.timelines, workers=self.workers,
            migration=self.migrations)

    def _kv_role(self) -> str:
        """The role this instance plays for KV: `--role`, or what `kv_role` in the transfer config implies."""
        kv_role = self.config.kv_transfer_config.get("kv_role")
        if self.config.role == "both" and kv_role in _ROLE_OF_KV_ROLE:
            return _ROLE_OF_KV_ROLE[kv_role]
        return self.config.role

    def _extra_metrics(self, serving: OpenAIServing | EncodeServing):
        sources = []
        if self.connectors is not None:
            sources.append(self.connectors.metrics)
        if self.ec is not None:
            sources.append(self.ec.stats)
        if self.migrations is not None:
            sources.append(self.migrations.metrics)
        if isinstance(serving, EncodeServing):
            sources.append(serving.stats)
        if self.kv_events is not None:
            sources.append(self.kv_events.stats)

        def collect() -> dict[str, float]:
            merged: dict[str, float] = {}
            for source in sources:
                merged.update(source())
            return merged

        return collect

    def _transfer_routes(self, app: FastAPI) -> None:
        bundle = self.connectors

        @app.get("/v1/kv/info")
        async def info() -> Response:
            """Where this instance's side channel is: what a gateway puts in a push-mode decode leg."""
            return json_response({"engine_id": bundle.engine_id, "side_channel_host": bundle.agent.config.host,
                                  "side_channel_port": bundle.agent.port, "role": self.config.role})

        @app.post("/v1/kv/faults")
        async def faults(request: Request) -> Response:
            """Switch fault injection at run time, for drills (only if the instance was started allowing it)."""
            try:
                body = msgspec.json.decode(await request.body())
                answer = bundle.set_faults(body if isinstance(body, dict) else {})
                client = request.client
                log.info("admin: %s set fault injection to %s", f"{client.host}:{client.port}" if client else "?",
                         answer["faults"])
                return json_response(answer)
            except (msgspec.DecodeError, ValueError, TypeError) as exc:
                return json_response(error_body(400, str(exc)), 400)

        @app.post("/v1/kv/release")
        async def release(request: Request) -> Response:
            """Free KV held for a transfer now (a gateway's explicit message; never wait for the lease)."""
            try:
                params = msgspec.json.decode(await request.body())
                released = bundle.release_local(params if isinstance(params, dict) else {})
            except (msgspec.DecodeError, ValueError) as exc:
                return json_response(error_body(400, str(exc)), 400)
            return json_response({"released": released})

    def _prompter(self) -> MultimodalPrompter | None:
        vision = self.engine.vision
        if vision is None:
            return None
        return MultimodalPrompter(self.engine.tokenizer, vision.image_processor, vision.image_token_id,
                                  vision.num_image_tokens,
                                  MediaPolicy(self.config.allowed_local_media_path, self.config.allow_remote_media))

    def ready_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"role": self.config.role, "model": self.config.model_name,
                                  "kv_block_bytes": self.engine.runner.kv_block_bytes(),
                                  "kv_blocks": self.engine.kv.num_blocks}
        if self.connectors is not None:
            fields.update(self.connectors.ready_fields())
        return fields

    async def stop(self) -> None:
        if self.migrations is not None:
            self.migrations.stop()
        if self.connectors is not None:
            await self.connectors.stop()
        if self.ec is not None:
            self.ec.stop()
        self.async_engine.stop()
        if self.kv_events is not None:
            self.kv_events.close()
        self.workers.shutdown()
        if self.tracing is not None:
            self.tracing.shutdown()  # exports the spans still queued


def _exit_now(exc: BaseException) -> None:
    """The engine failed where its state may be half-updated (blocks, queues): serving on would hand out wrong
    or stuck answers, so the process ends at once and its supervisor starts a clean one."""
    log.critical("engine state is inconsistent after an unexpected error (%s: %s); exiting with status %d so a "
                 "supervisor restarts this instance", type(exc).__name__, exc, ENGINE_FAILED_EXIT)
    logging.shutdown()
    os._exit(ENGINE_FAILED_EXIT)
