"""A completion with a list of prompts, through a PD protocol: one request per prompt, answers merged into one.

kv_transfer_params describe one prompt's KV (vLLM's wire has no list form), so each prompt runs its own legs,
transfer and retries, concurrently, as its own request (`<request id>-<prompt index>`, vLLM's per-prompt suffix).
The client gets what a colocated instance answers: choice `index` = prompt index * n + sample index, usage
summed, one stream ending in one `[DONE]` (the usage chunk, if asked for, summed and sent last).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.decode

Handle = Callable[[dict[str, Any], str, Any], Awaitable[None]]  # (body, request id, ASGI send)


def split_prompts(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """One body per prompt when `prompt` lists several (strings, or token-id lists); else None."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2 or not all(isinstance(p, (str, list)) for p in prompt):
        return None  # one prompt (a string, or one list of token ids): the protocol runs as it is
    return [{**body, "prompt": p} for p in prompt]


def _add_usage(total: dict[str, Any], usage: dict[str, Any] | None) -> None:
    if not isinstance(usage, dict):
        return
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        total[key] = total.get(key, 0) + (usage.get(key) or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    details = total.setdefault("prompt_tokens_details", {"cached_tokens": 0})
    details["cached_tokens"] += cached


@dataclass
class _Part:
    """One prompt's answer as its request wrote it."""

    status: int = 0
    body: bytearray = field(default_factory=bytearray)


@dataclass
class PromptListMerger:
    request_id: str
    send: Any  # the client's ASGI send
    n: int
    stream: bool
    parts: list[_Part] = field(default_factory=list)
    _started: bool = False
    _head: dict[str, Any] | None = None  # id, object, created, model of the first chunk the client saw
    _usage: dict[str, Any] = field(default_factory=dict)
    _saw_usage: bool = False

    async def run(self, handle: Handle, bodies: list[dict[str, Any]]) -> None:
        self.parts = [_Part() for _ in bodies]
        await asyncio.gather(*(handle(body, f"{self.request_id}-{i}", self._sender(i))
                               for i, body in enumerate(bodies)))
        if self.stream:
            await self._end_stream()
        else:
            await self._respond()

    def _sender(self, index: int) -> Callable[[dict[str, Any]], Awaitable[None]]:
        part = self.parts[index]

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                part.status = message["status"]
            elif self.stream and part.status == 200:
                await self._forward(index, message.get("body", b""))
            else:
                part.body += message.get("body", b"")
        return send

    # -- one JSON answer ------------------------------------------------------------------------------------
    async def _respond(self) -> None:
        failed = next((p for p in self.parts if p.status != 200), None)
        if failed is not None:
            await self._start(failed.status, b"application/json")
            await self.send({"type": "http.response.body", "body": bytes(failed.body), "more_body": False})
            return
        answers = [_decode(bytes(p.body)) for p in self.parts]
        merged = answers[0]
        merged["choices"] = [{**choice, "index": i * self.n + choice["index"]}
                             for i, answer in enumerate(answers) for choice in answer["choices"]]
        usage: dict[str, Any] = {}
        for answer in answers:
            _add_usage(usage, answer.get("usage"))
        merged["usage"] = usage
        merged["kv_transfer_params"] = None  # as a colocated instance answers several sequences
        await self._start(200, b"application/json")
        await self.send({"type": "http.response.body", "body": _encode(merged), "more_body": False})

    async def _start(self, status: int, content_type: bytes) -> None:
        self._started = True
        await self.send({"type": "http.response.start", "status": status,
                         "headers": [(b"content-type", content_type), (b"x-request-id", self.request_id.encode())]})

    # -- one stream -----------------------------------------------------------------------------------------
    async def _forward(self, index: int, data: bytes) -> None:
        """Relay a prompt's whole SSE events at once, renumbered; hold back its usage chunk and [DONE]."""
        out = []
        for event in data.split(b"\n\n"):
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            try:
                chunk = _decode(event[6:])
            except msgspec.DecodeError:
                out.append(event + b"\n\n")  # not ours to judge: pass it on as it came
                continue
            if isinstance(chunk, dict) and isinstance(chunk.get("choices"), list):
                if not chunk["choices"] and chunk.get("usage") is not None:
                    self._saw_usage = True
                    _add_usage(self._usage, chunk["usage"])
                    continue
                if self._head is None:
                    self._head = {k: chunk.get(k) for k in ("id", "object", "created", "model")}
                chunk.update(id=self._head["id"], created=self._head["created"])
                for choice in chunk["choices"]:
                    choice["index"] = index * self.n + choice.get("index", 0)
            out.append(b"data: " + _encode(chunk) + b"\n\n")
        if out:
            if not self._started:
                await self._start(200, b"text/event-stream")
            await self.send({"type": "http.response.body", "body": b"".join(out), "more_body": True})

    async def _end_stream(self) -> None:
        failed = next((p for p in self.parts if p.status != 200), None)
        if not self._started and failed is not None:
            await self._start(failed.status, b"application/json")
            await self.send({"type": "http.response.body", "body": bytes(failed.body), "more_body": False})
            return
        if not self._started:
            await self._start(200, b"text/event-stream")
        tail = [b"data: " + bytes(p.body) + b"\n\n" for p in self.parts if p.status != 200]  # late failures
        if self._saw_usage and self._head is not None:
            tail.append(b"data: " + _encode({**self._head, "choices": [], "usage": self._usage}) + b"\n\n")
        tail.append(b"data: [DONE]\n\n")
        await self.send({"type": "http.response.body", "body": b"".join(tail), "more_body": False})
