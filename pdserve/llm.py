"""Offline generation in one call, the way `vllm.LLM` is used: for scripts, tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import TokenLogprobs
from pdserve.ids import ReqId
from pdserve.sampling_params import SamplingParams


@dataclass(slots=True)
class SequenceResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class GenerationResult:
    prompt_token_ids: list[int]
    outputs: list[SequenceResult]
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[GenerationResult]:
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        results: list[GenerationResult] = []
        owner: dict[ReqId, SequenceResult] = {}
        cached: dict[ReqId, GenerationResult] = {}
        for index, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            p.validate(self.engine.vocab_size)  # the engine trusts the parameters it is given
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            result = GenerationResult(prompt_token_ids=ids, outputs=[])
            for child in range(p.n):
                seq = SequenceResult()
                rid = self.engine.add_request(f"offline-{index}-{child}", ids, p.for_child(child))
                owner[rid] = seq
                cached[rid] = result
                result.outputs.append(seq)
            results.append(result)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                seq = owner[out.request_id]
                seq.token_ids.extend(out.new_token_ids)
                seq.text += out.new_text
                seq.logprobs.extend(out.new_logprobs)
                if out.finished:
                    seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
                    cached[out.request_id].num_cached_tokens = out.num_cached_tokens
        return results
