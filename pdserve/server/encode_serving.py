"""The `encode` role's endpoint: run the vision encoder on a chat request's images, store each output through
the EC connector, and answer with `ec_transfer_params` per item (vLLM's encoder-only instance, in shape).

An item whose output is already stored is not encoded again. Encoding runs on the engine thread, between steps.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from pdserve.ec_transfer.base import ECConnector
from pdserve.engine.async_engine import AsyncEngine
from pdserve.multimodal.items import mm_hash_of
from pdserve.multimodal.prompt import MultimodalInputError, MultimodalPrompter
from pdserve.server.errors import OpenAIError, bad_request
from pdserve.server.protocol import ChatCompletionRequest
from pdserve.server.workers import WorkerPool
from pdserve.telemetry.timeline import Origin, TimelineStore


class EncodeServing:
    def __init__(self, engine: AsyncEngine, model_name: str, prompter: MultimodalPrompter, ec: ECConnector,
                 timelines: TimelineStore | None = None, workers: WorkerPool | None = None) -> None:
        self.engine = engine
        self.workers = workers or WorkerPool()
        self.model_name = model_name
        self.max_model_len = engine.engine.max_model_len
        self.prompter = prompter
        self.ec = ec
        self.role = "encode"
        self.timelines = timelines or TimelineStore()
        self.encoded = 0  # items run through the encoder
        self.reused = 0  # items whose stored output was still there

    async def chat(self, body: ChatCompletionRequest, origin: Origin,
                   headers: dict[str, str] | None = None) -> dict[str, Any]:
        timeline = self.timelines.start(origin.request_id, self.role, origin.arrival_ns,
                                        traceparent=origin.traceparent)
        try:
            answer = await self._encode(body, origin, timeline.add)
        finally:
            timeline.finish(reason="stop")
        return answer

    async def _encode(self, body: ChatCompletionRequest, origin: Origin, mark: Any) -> dict[str, Any]:
        if body.model is not None and body.model != self.model_name:
            raise OpenAIError(404, f"The model `{body.model}` does not exist.", "model", "NotFoundError")
        try:
            parts = await self.workers.run(self.prompter.image_parts, body.message_dicts())
        except MultimodalInputError as exc:
            raise bad_request(str(exc), "messages") from exc
        if not parts:
            raise bad_request("an encode instance needs at least one image", "messages")
        fingerprint = self.prompter.processor.settings_fingerprint()
        hashes = await self.workers.run(lambda: [mm_hash_of(part, fingerprint) for part in parts])
        params: dict[str, dict[str, Any]] = {}
        pending: dict[str, Any] = {}
        for part, mm_hash in zip(parts, hashes, strict=True):
            if mm_hash in params or mm_hash in pending:
                continue
            stored = self.ec.holds(mm_hash)
            if stored is not None:
                params[mm_hash] = stored.to_wire()
                self.reused += 1
            else:
                pending[mm_hash] = await self.workers.run(self.prompter.processor, part.image)
        if pending:
            mark("encode_start", items=len(pending))
            outputs = await self.engine.call(lambda engine: engine.vision.encode(torch.stack(list(pending.values()))))
            for mm_hash, output in zip(pending, outputs, strict=True):
                params[mm_hash] = (await asyncio.to_thread(self.ec.save, mm_hash, output)).to_wire()
            self.encoded += len(pending)
            mark("encode_end", items=len(pending))
        return {
            "id": f"chatcmpl-{origin.request_id}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop",
                         "logprobs": None}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            "ec_transfer_params": params,
            "mm_items": [{"index": i, "mm_hash": h} for i, h in enumerate(hashes)],
        }

    async def completions(self, body: Any, origin: Origin, headers: dict[str, str] | None = None) -> dict:
        raise bad_request("an encode instance only encodes images sent to /v1/chat/completions")

    def stats(self) -> dict[str, float]:
        return {"counter pdserve:encoder_runs": self.encoded, "counter pdserve:encode_reused": self.reused}
