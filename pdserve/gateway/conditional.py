"""Conditional disaggregation: send a request to D alone (D prefills locally) when a remote prefill does not
pay — the prompt is short, or the chosen D already holds most of it. Every decision is counted with its reason.

Prompt length is counted exactly when the gateway has the model's tokenizer (`--tokenizer`) or the prompt is
token ids; otherwise it is estimated from UTF-8 bytes (4 per token) and the metric's reason says so. Whether D
holds the prompt comes from the KV-event prefix index when the policy is `kv_aware` (what D's events say it holds
when it was picked), else from the prompts this gateway recently sent to D.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import msgspec

from pdserve.gateway.encode import client_messages
from pdserve.gateway.registry import Instance
from pdserve.kv_events.prompt import PromptTokenizer, RoutedPrompt


_BYTES_PER_TOKEN = 4
_CHUNK_TOKENS = 16
# Larger ids are no token of any vocabulary (the instance refuses them) and do not fit msgpack's integers.
_MAX_TOKEN_ID = 2**31 - 1


class PrefixTracker:
    """Which prompt prefixes each decode instance recently computed (an LRU of chained chunk hashes)."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._seen: dict[str, OrderedDict[bytes, None]] = {}

    def overlap(self, instance: Instance, chunks: list[bytes]) -> float:
        seen = self._seen.get(instance.url)
        if not seen or not chunks:
            return 0.0
        hits = 0
        for key in chunks:
            if key not in seen:
                break
            hits += 1
        return hits / len(chunks)

    def record(self, instance: Instance, chunks: list[bytes]) -> None:
        seen = self._seen.setdefault(instance.url, OrderedDict())
        for key in chunks:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.capacity:
            seen.popitem(last=False)


class ConditionalDisagg:
    def __init__(self, metrics: Any, enabled: bool = False, min_prompt_tokens: int = 0,
                 prefix_threshold: float = 0.8, tokenizer: PromptTokenizer | None = None) -> None:
        self.metrics = metrics
        self.enabled = enabled
        self.min_prompt_tokens = min_prompt_tokens
        self.prefix_threshold = prefix_threshold
        self.tracker = PrefixTracker()
        self.tokenizer = tokenizer

    def use_remote_prefill(self, body: dict[str, Any], decode: Instance, prompt: RoutedPrompt | None = None) -> bool:
        """True: run P then D. False: D alone. Records the decision and its reason. `prompt`: the request's
        token ids as routing saw them, with what the index credited D with when D was picked."""
        if not self.enabled:
            self.metrics.decision("remote_prefill", "always")
            return True
        tokens, exact = (prompt.tokens, True) if prompt is not None and prompt.tokens else self.prompt_tokens(body)
        chunks = self.chunks(tokens)
        count = len(tokens) if exact else len(tokens) // _BYTES_PER_TOKEN
        held = prompt.cached.get(decode.url) if prompt is not None else None
        overlap = held / count if held is not None and count else self.tracker.overlap(decode, chunks)
        remote, reason = self._decide(count, exact, overlap if chunks or held else 0.0)
        self.tracker.record(decode, chunks)
        self.metrics.decision("remote_prefill" if remote else "local_prefill", reason)
        return remote

    def _decide(self, num_tokens: int, exact: bool, overlap: float) -> tuple[bool, str]:
        if num_tokens < self.min_prompt_tokens:
            return False, "short_prompt" if exact else "short_prompt_estimated"
        if overlap and overlap >= self.prefix_threshold:
            return False, "decode_holds_prefix"
        return True, "long_prompt"

    def prompt_tokens(self, body: dict[str, Any]) -> tuple[list[int] | bytes, bool]:
        """The prompt as token ids when they can be known exactly, else as UTF-8 bytes (approximate)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t <= _MAX_TOKEN_ID
                                                       for t in prompt):
            return prompt, True
        if self.tokenizer is not None:
            tokens = self.tokenizer.prompt(body).tokens
            if tokens is not None:
                return tokens, True
        if prompt is None:
            text = "\n".join(str(m.get("content", "")) for m in client_messages(body) if isinstance(m, dict))
        else:
            text = prompt if isinstance(prompt, str) else msgspec.json.encode(prompt).decode()
        raw = text.encode()
        return raw[: len(raw) // _BYTES_PER_TOKEN * _BYTES_PER_TOKEN], False

    @staticmethod
    def chunks(tokens: list[int] | bytes) -> list[bytes]:
        """Chained hashes of whole chunks, so two prompts share a key exactly when they share that prefix."""
        step = _CHUNK_TOKENS * (_BYTES_PER_TOKEN if isinstance(tokens, bytes) else 1)
        keys, parent = [], b""
        for start in range(0, len(tokens) - step + 1, step):
            piece = tokens[start:start + step]
            data = piece if isinstance(piece, bytes) else msgspec.msgpack.encode(piece)
            parent = hashlib.blake2b(parent + data, digest_size=12).digest()
            keys.append(parent)
        return keys
