"""The engine: a scheduler, a model runner and an output processor, driven one step at a time."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.config import EngineConfig
from pdserve.ec_transfer.base import ECConnector
from pdserve.ec_transfer.factory import ec_policy
from pdserve.ec_transfer.params import ECSource
from pdserve.engine.block_pool import ROOT_HASH
from pdserve.engine.faults import EngineFaults
from pdserve.engine.host_memory import keep_freed_memory
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.output_processor import OutputProcessor, RequestOutput
from pdserve.engine.request import MultiModalItem, Request, RequestStatus
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.ids import ReqId, make_internal_request_id
from pdserve.kv_events.block_events import BlockEvents
from pdserve.kv_events.publisher import KVEventPublisher
from pdserve.kv_transfer.params import RemoteDecode, RemotePrefill
from pdserve.models.config import ModelSpec
from pdserve.sampling_params import SamplingParams
from pdserve.telemetry.timeline import Timeline
from pdserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt the engine cannot take (too long, empty, out-of-vocabulary ids); the server answers 400."""


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_held: int
    blocks_used: int
    blocks_total: int
    kv_cache_usage: float
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    prompt_tokens_computed: int
    encoder_entries: int = 0
    encoder_entries_held: int = 0
    encoder_hits: int = 0
    encoder_misses: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, connectors: Any = None, model: ModelSpec | None = None,
                 ec: ECConnector | None = None) -> None:
        """`connectors` (see pdserve.kv_transfer.factory) supplies connector halves and the KV allocator; `model`
        is the resolved config.json when the caller already read it (an instance does, for its connectors); `ec`
        loads encoder outputs computed elsewhere. The instance builds connectors of both kinds, in one place."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        keep_freed_memory()  # a step reuses the pages the last one freed (see engine/host_memory.py)
        model = model or config.resolve_model()
        self.dtype = model.dtype
        self.max_model_len = model.max_model_len
        self.tokenizer = Tokenizer(config.tokenizer or config.model)
        worker_half = connectors.worker if connectors is not None else None
        self.runner = ModelRunner(model, config.block_size, config.seed, config.device, connector=worker_half,
                                  attention_backend=config.attention_backend)
        self.faults = self.runner.faults = EngineFaults.from_env()
        self.vocab_size = self.runner.cfg.vocab_size
        self.eos_token_ids = self.tokenizer.eos_token_ids or self.runner.cfg.eos_token_ids
        num_blocks = config.resolve_num_blocks(self.runner.kv_block_bytes(), self.max_model_len)
        self.runner.allocate_kv_cache(num_blocks, connectors.kv_allocator if connectors is not None else None)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.max_seq_len = max_sequence_length(config, self.max_model_len, num_blocks)
        if ec is not None:
            self.runner.ec_loader = lambda item: ec.load(item.mm_hash, item.source or ECSource())
        sched_cfg = SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_seq_len, enable_chunked_prefill=config.enable_chunked_prefill,
            kv_load_failure_policy=config.kv_transfer_config.get("kv_load_failure_policy", "recompute"),
            ec_load_failure_policy=ec_policy(config.ec_transfer_config),
            encoder_cache_size=config.encoder_cache_size or max(config.max_num_batched_tokens, 8192))
        self.scheduler = Scheduler(sched_cfg, self.kv, connectors.scheduler if connectors is not None else None)
        self.output = OutputProcessor(self.tokenizer)
        self.last_step_tokens = 0
        self.block_events: BlockEvents | None = None
        log.info("engine ready: %s, dtype %s, %d KV blocks of %d tokens, max_model_len %d", config.model,
                 self.dtype, num_blocks, config.block_size, self.max_model_len)

    # -- requests ---------------------------------------------------------------------------------------
    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise PromptError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"{len(prompt_token_ids)} tokens, which leaves no room to generate.")
        if len(prompt_token_ids) >= self.max_seq_len:
            raise PromptError(
                f"This engine runs sequences of at most {self.max_seq_len} tokens (KV cache size, or "
                f"max_num_batched_tokens without chunked prefill). However, your prompt has "
                f"{len(prompt_token_ids)} tokens, which leaves no room to generate.")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"token id {bad[0]} is out of vocabulary (vocab size {self.vocab_size})")

    def add_request(self, external_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_transfer_params: RemoteDecode | RemotePrefill | None = None,
                    mm_items: list[MultiModalItem] | None = None,
                    request_id: ReqId | None = None, detokenize: bool = True,
                    timeline: Timeline | None = None) -> ReqId:
        self.check_prompt(prompt_token_ids)  # params were validated by whoever took the request (server, LLM)
        rid = request_id or make_internal_request_id(external_id)
        request = Request(request_id=rid, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
                          eos_token_ids=self.eos_token_ids, external_id=external_id,
                          kv_transfer_params=kv_transfer_params, mm_items=mm_items or [], timeline=timeline)
        request.mark("queued")
        self.output.add_request(request, detokenize)
        self.scheduler.add_request(request)
        return rid

    def abort_request(self, request_id: ReqId, status: RequestStatus = RequestStatus.FINISHED_ABORTED
                      ) -> list[RequestOutput]:
        ended = self.scheduler.finish_requests([request_id], status)
        outputs, _ = self.output.process(ended)
        self.output.drop(request_id)
        return outputs

    # -- the loop ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        result = self.runner.execute_model(plan)
        self.last_step_tokens = plan.num_scheduled_tokens
        touched = self.scheduler.update_from_output(plan, result)
        if self.block_events is not None:
            self.block_events.end_step()  # what this step cached or evicted goes out now, never before
        self.faults.check_step(plan.scheduled)
        return self._process(touched)

    def publish_kv_events(self, publisher: KVEventPublisher) -> None:
        """Tell `publisher` what enters and leaves the prefix cache from now on (before the engine runs)."""
        self.block_events = BlockEvents(publisher, self.config.block_size, ROOT_HASH)
        self.kv.pool.events = self.block_events

    def _process(self, touched: list[Request]) -> list[RequestOutput]:
        outputs, stopped = self.output.process(touched)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
            # Those outputs were built before finishing; attach what finishing handed back.
            by_id = {r.request_id: r for r in touched}
            for out in outputs:
                if out.request_id in stopped:
                    out.kv_transfer_params = by_id[out.request_id].returned_kv_transfer_params
        return outputs

    @property
    def vision(self):
        """The vision encoder (with its image processor) of a multimodal model, else None."""
        return self.runner.vision

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_ready_work(self) -> bool:
        """Whether the next step can compute something now (e.g. a request whose KV just arrived)."""
        return self.last_step_tokens > 0 or bool(self.scheduler.finished_recving)

    def has_work(self) -> bool:
        worker = self.runner.connector
        return self.scheduler.has_work() or (worker is not None and worker.has_pending_work())

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_held=len(self.scheduler.held), blocks_used=self.kv.num_used_blocks, blocks_total=self.kv.num_blocks,
            kv_cache_usage=self.kv.usage, prefix_queries=self.kv.prefix_queries, prefix_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed,
            encoder_entries=self.scheduler.encoder_cache.num_entries,
            encoder_entries_held=self.scheduler.encoder_cache.num_held,
            encoder_hits=self.scheduler.encoder_cache.hits, encoder_misses=self.scheduler.encoder_cache.misses)


def max_sequence_length(config: EngineConfig, max_model_len: int, num_blocks: int) -> int:
    """The longest sequence this engine can ever schedule; longer ones are length-capped (or prompts refused).

    A sequence can use at most the whole KV cache (num_kv_blocks may undercut max_model_len), and without
    chunked prefill its prompt, or its prompt and output recomputed after a preemption, must fit in one step's
    token budget. Past either limit a request would wait forever for a step that can never take it.
    """
    limit = min(max_model_len, num_blocks * config.block_size)
    if not config.enable_chunked_prefill:
        limit = min(limit, config.max_num_batched_tokens)
    return limit

