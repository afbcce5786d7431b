"""One serving instance: engine, its async driver, its connectors, and the HTTP app in front of them."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from pdserve.config import EngineConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_transfer.factory import build_connectors
from pdserve.server.app import build_app
from pdserve.server.metrics import ServerMetrics
from pdserve.server.serving import OpenAIServing


class Instance:
    def __init__(self, config: EngineConfig, request_timeout_s: float = 600.0) -> None:
        self.config = config
        self.connectors = build_connectors(config)
        self.engine = LLMEngine(config, self.connectors)
        self.async_engine = AsyncEngine(self.engine, request_timeout_s)

    async def start(self, advertised_host: str = "127.0.0.1") -> FastAPI:
        self.async_engine.start()
        check_kv = reject_kv = None
        extra_stats = dict
        if self.connectors is not None:
            await self.connectors.start(self.async_engine, advertised_host)
            check_kv = self.connectors.check_request_params
            reject_kv = self.connectors.reject
            extra_stats = self.connectors.metrics
        serving = OpenAIServing(self.async_engine, self.config.model_name, self.engine.tokenizer,
                                self.engine.max_model_len, check_kv, reject_kv)
        metrics = ServerMetrics(self.config.model_name, self.engine.stats, extra_stats)
        return build_app(self.async_engine, serving, metrics)

    def ready_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"role": self.config.role, "model": self.config.model_name,
                                  "kv_block_bytes": self.engine.runner.kv_block_bytes(),
                                  "kv_blocks": self.engine.kv.num_blocks}
        if self.connectors is not None:
            fields.update(self.connectors.ready_fields())
        return fields

    async def stop(self) -> None:
        if self.connectors is not None:
            await self.connectors.stop()
        self.async_engine.stop()
