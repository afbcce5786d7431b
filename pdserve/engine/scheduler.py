"""The scheduler: which tokens of which requests run this step. It plans; it never touches tensors.

Continuous batching in vLLM v1's shape: one token budget per step shared by running requests (decodes and
unfinished prefill chunks, served first) and then waiting ones; chunked prefill cuts a prompt to the budget;
when blocks run out the most recently admitted running request is preempted and later recomputed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pdserve.engine.encoder_cache import EncoderCacheManager
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.outputs import KVConnectorOutput, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.ids import ReqId
from pdserve.kv_transfer.base import KVConnectorScheduler
from pdserve.kv_transfer.params import RemotePrefill
from pdserve.telemetry.timeline import wall_ns_of


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    kv_load_failure_policy: str = "recompute"  # or "fail"
    ec_load_failure_policy: str = "recompute"  # or "fail"
    encoder_cache_size: int = 8192  # embeddings the runner may keep


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, connector: KVConnectorScheduler | None = None) -> None:
        self.config = config
        self.kv = kv
        self.connector = connector
        self.requests: dict[ReqId, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished requests whose blocks a connector still holds (delayed free).
        self.held: dict[ReqId, Request] = {}
        self.finished_recving: set[ReqId] = set()
        self.failed_recving: set[ReqId] = set()
        self._finished_since_last_step: set[ReqId] = set()
        self._ended: list[Request] = []
        self.num_prompt_tokens_computed = 0  # prompt tokens this engine computed itself (not hit, not transferred)  # ended by the scheduler itself; each still owes its client an output
        self.num_preemptions = 0
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_size)

    # -- queries ----------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_work(self) -> bool:
        pending = self.connector is not None and self.connector.has_pending_work()
        return self.has_unfinished_requests() or bool(self.held) or pending

    # -- admission --------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.connector is not None:
            self.connector.on_new_request(request)

    # -- planning ---------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._fail_connector_rejected()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: set[ReqId] = set()

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            if not self._allocate_or_preempt(request, num_new, preempted):
                break
            scheduled.append((request, num_new))
            budget -= num_new
            index += 1

        if not preempted:
            budget = self._admit_waiting(budget, scheduled)

        now = time.monotonic()
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        for request, num_new in scheduled:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.mark("scheduled")
            start = request.num_computed_tokens
            if start < request.num_prompt_tokens:
                request.mark("prefill_chunk", start=start, tokens=min(num_new, request.num_prompt_tokens - start))
            items = [m for m in request.mm_items if m.offset < start + num_new and m.offset + m.length > start]
            out.scheduled.append(ScheduledRequest(
                request_id=request.request_id,
                token_ids=request.token_ids_range(start, start + num_new),
                start_position=start,
                block_ids=self.kv.block_ids(request.request_id),
                sample=start + num_new == request.num_tokens,
                sampling_params=request.sampling_params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                eos_token_ids=request.eos_token_ids,
                mm_items=items,
                mm_to_produce={m.mm_hash for m in items
                               if self.encoder_cache.use(m.mm_hash, m.length, request.request_id)},
            ))
        out.free_mm_hashes = self.encoder_cache.take_freed()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: set[ReqId]) -> bool:
        """Make room for `request`, preempting from the back of the running list; False if it was preempted."""
        while self.kv.allocate_slots(request, request.num_computed_tokens + num_new) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        self.encoder_cache.release(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> int:
        skipped: deque[Request] = deque()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not self._remote_load_done(request):
                if not request.is_finished:
                    skipped.append(request)
                continue
            outcome = self._try_admit(request, budget)
            if outcome is None:  # out of blocks: stop admitting this step
                self.waiting.appendleft(request)
                break
            if outcome < 0:  # parked (remote load in flight or connector asked to retry later)
                skipped.append(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, outcome))
            budget -= outcome
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _try_admit(self, request: Request, budget: int) -> int | None:
        """Allocate for a waiting request. Returns tokens to run now, -1 if parked, None if blocks ran out."""
        hits, num_local = [], 0
        num_external, load_async = 0, False
        # A request rolled back to token 0 keeps its blocks; only one without any looks up the prefix cache and
        # asks the connector (a preempted request gave all of its blocks back).
        fresh = not self.kv.has_blocks(request.request_id)
        if fresh:
            hits, num_local = self.kv.get_computed_blocks(request)
            if self.connector is not None:
                matched, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
                if matched is None:
                    return -1
                num_external = matched
        num_computed = request.num_computed_tokens + num_local + num_external
        if load_async:
            num_new = 0
        else:
            num_new = min(request.num_tokens - num_computed, budget)
            if num_new < request.num_tokens - num_computed and not self.config.enable_chunked_prefill:
                return None
        block_ids = self.kv.allocate_slots(request, num_computed + num_new, hits)
        if block_ids is None:
            return None
        if fresh:
            self.kv.record_prefix_lookup(request.num_tokens, num_local)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_local
            if self.connector is not None:
                self.connector.update_state_after_alloc(request, block_ids, num_external)
        request.num_computed_tokens = num_computed
        if load_async:
            request.num_external_tokens = num_external
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return -1
        return num_new

    def _remote_load_done(self, request: Request) -> bool:
        """A remote load finished (or failed): settle num_computed_tokens and make the request schedulable."""
        rid = request.request_id
        if rid not in self.finished_recving:
            return False
        self.finished_recving.discard(rid)
        if rid in self.failed_recving:
            self.failed_recving.discard(rid)
            if self.config.kv_load_failure_policy == "fail":
                self._end(request, "KV cache load from the prefill instance failed")
                return False
            # Recompute: keep the local prefix hit, compute what should have arrived, in the same blocks.
            request.num_computed_tokens -= request.num_external_tokens
            request.num_external_tokens = 0
        self.kv.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens >= request.num_tokens:
            # The whole prompt arrived; recompute its last token here to get the logits to sample from.
            request.num_computed_tokens = request.num_tokens - 1
        request.status = RequestStatus.WAITING
        return True

    # -- results ----------------------------------------------------------------------------------------
    def update_from_output(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance requests by what the runner computed; return those with a new token or a new ending."""
        touched: list[Request] = []
        for rid in result.failed_req_ids:
            request = self.requests.get(rid)
            if request is not None and not request.is_finished:
                self._end(request, result.error)
        rolled_back = self._handle_invalid_blocks(plan, result.connector)
        rolled_back |= self._handle_invalid_mm_items(plan, result.invalid_mm_hashes)
        now = time.monotonic()
        for item in plan.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.is_finished or item.request_id in rolled_back:
                continue
            request.num_computed_tokens += len(item.token_ids)
            self.num_prompt_tokens_computed += max(0, min(request.num_computed_tokens, request.num_prompt_tokens)
                                                   - item.start_position)
            self.kv.cache_blocks(request, request.num_computed_tokens)
            if not item.sample:
                continue
            token = result.sampled_token_ids[item.request_id]
            request.output_token_ids.append(token)
            if item.request_id in result.logprobs:
                request.output_logprobs.append(result.logprobs[item.request_id])
            if request.first_token_time is None:
                request.first_token_time = now
                request.mark("first_token")
            request.last_token_time = now
            status = self._stop_status(request)
            if status is not None:
                self._finish(request, status)
            touched.append(request)
        self._apply_connector_output(result.connector)
        touched.extend(self.take_ended())
        return touched

    def _stop_status(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_tokens >= self.config.max_model_len or request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_output_tokens < params.min_tokens:
            return None
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        return None

    def _apply_connector_output(self, output: KVConnectorOutput) -> None:
        if self.connector is None:
            return
        self.connector.update_connector_output(output)
        self.failed_recving |= output.failed_recving
        for rid, message in output.refused_recving.items():
            request = self.requests.get(rid)
            if request is not None and not request.is_finished:
                self._end(request, message, status=400)
        self._mark_transfers(output)
        for rid in output.finished_recving:
            held = self.held.pop(rid, None)
            if held is not None:  # aborted while its load was in flight: the blocks are free to reuse now
                self.kv.free(rid)
                self.requests.pop(rid, None)
            elif rid in self.requests:
                self.finished_recving.add(rid)
        for rid in output.finished_sending:
            held = self.held.pop(rid, None)
            if held is not None:
                self.kv.free(rid)
                self.requests.pop(rid, None)

    def _mark_transfers(self, output: KVConnectorOutput) -> None:
        for rid, record in output.transfers.items():
            request = self.requests.get(rid)
            if request is None or request.timeline is None:
                continue
            mode = request.kv_transfer_params.mode if isinstance(request.kv_transfer_params, RemotePrefill) else ""
            start = wall_ns_of(record.started_at)
            request.timeline.add("kv_transfer_start", start, data_plane=record.data_plane, mode=mode)
            request.timeline.add("kv_transfer_end", start + int(record.seconds * 1e9), bytes=record.nbytes,
                                 data_plane=record.data_plane, ok=record.ok, mode=mode)

    def _handle_invalid_blocks(self, plan: SchedulerOutput, output: KVConnectorOutput) -> set[ReqId]:
        """Roll requests back to their first block that failed to load (recompute) or end them (fail)."""
        if not output.invalid_block_ids:
            return set()
        affected: set[ReqId] = set()
        bs = self.kv.block_size
        for rid, request in list(self.requests.items()):
            if request.is_finished:
                continue
            table = self.kv.block_ids(rid)
            bad = [i for i, b in enumerate(table) if b in output.invalid_block_ids and i * bs < request.num_computed_tokens]
            if not bad:
                continue
            affected.add(rid)
            first = bad[0]
            self.kv.invalidate_from(rid, first)
            # A prefill instance's KV that failed fails the request under `fail`; a store's is only a miss.
            if self.config.kv_load_failure_policy == "fail" and isinstance(request.kv_transfer_params, RemotePrefill):
                self._end(request, "KV cache load failed (invalid blocks)")
                continue
            request.num_computed_tokens = min(request.num_computed_tokens, first * bs)
        return affected

    def _handle_invalid_mm_items(self, plan: SchedulerOutput, invalid: dict[str, str]) -> set[ReqId]:
        """Encoder outputs that failed to load (optimistic EC scheduling): roll each affected request back to the smallest
        placeholder offset among its failed items and clear their remote flag, so the retry encodes locally;
        or end it with an error under the `fail` policy."""
        if not invalid:
            return set()
        for mm_hash in invalid:
            self.encoder_cache.forget(mm_hash)
        affected: set[ReqId] = set()
        for item in plan.scheduled:
            failed = [m for m in item.mm_items if m.mm_hash in invalid]
            request = self.requests.get(item.request_id)
            if not failed or request is None or request.is_finished:
                continue
            affected.add(item.request_id)
            if self.config.ec_load_failure_policy == "fail":
                self._end(request, f"encoder output load failed: {invalid[failed[0].mm_hash]}")
                continue
            request.num_computed_tokens = min(request.num_computed_tokens, min(m.offset for m in failed))
            for m in request.mm_items:
                if m.mm_hash in invalid:
                    m.remote = False
        return affected

    # -- endings ----------------------------------------------------------------------------------------
    def finish_requests(self, request_ids: list[ReqId], status: RequestStatus, error: str | None = None) -> list[Request]:
        ended = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            self._finish(request, status, error)
            ended.append(request)
        return ended

    def _finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        request.status = status
        request.error = error
        if request.timeline is not None:
            request.timeline.finish(reason=status.finish_reason, prompt_tokens=request.num_prompt_tokens,
                                    completion_tokens=request.num_output_tokens)
        rid = request.request_id
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finished_since_last_step.add(rid)
        self.finished_recving.discard(rid)
        self.encoder_cache.release(rid)
        delay_free = False
        if self.connector is not None:
            delay_free, params = self.connector.request_finished(request, self.kv.block_ids(rid))
            request.returned_kv_transfer_params = params
        if delay_free:
            self.held[rid] = request
        else:
            self.kv.free(rid)
            self.requests.pop(rid, None)

    def _fail_connector_rejected(self) -> None:
        if self.connector is None:
            return
        for rid, message in self.connector.take_request_errors().items():
            request = self.requests.get(rid)
            if request is not None and not request.is_finished:
                self._end(request, message, status=400)

    def _end(self, request: Request, error: str, status: int = 500) -> None:
        request.error_status = status
        self._finish(request, RequestStatus.FINISHED_ERROR, error=error)
        self._ended.append(request)

    def take_ended(self) -> list[Request]:
        out, self._ended = self._ended, []
        return out
