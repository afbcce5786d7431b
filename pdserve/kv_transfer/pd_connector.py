"""PdConnector: prefill→decode KV transfer in vLLM NIXL's pull shape (push and decode-first build on it).

Scheduler half: decides which tokens are remote, which blocks to hold for whom, and what to tell the client.
Worker half: turns each step's plan into agent work (holds, loads, releases, heartbeats) and reports what
finished. The two halves share nothing but ``PdConnectorMetadata``.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.engine.outputs import KVConnectorOutput, SchedulerOutput, TransferRecord
from pdserve.engine.request import Request, RequestStatus
from pdserve.ids import ReqId, TransferId
from pdserve.kv_transfer.agent import TransferAgent
from pdserve.kv_transfer.base import KVConnectorMetadata, KVConnectorScheduler, KVConnectorWorker
from pdserve.kv_transfer.params import VLLM_NIXL, KVHandOff, PushHeld, RemoteDecode, RemotePrefill, prompt_hash
from pdserve.kv_transfer.pull_consumer import LoadJob
from pdserve.kv_transfer.push import PushChunk, PushEnded, PushProducer, PushRegistration
from pdserve.kv_transfer.translator import TransferMap
from pdserve.kv_transfer.vllm_nixl.mirror_plan import MirrorPlan
from pdserve.kv_transfer.vllm_nixl.producer import MirrorFill
from pdserve.utils import cdiv

log = logging.getLogger(__name__)

# P finished its one token and hands the prompt's KV over (vLLM also accepts a stop on that token).
_HANDOFF_STATUSES = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
PROMPT_MISMATCH = ("KV transfer refused: the prefill instance's KV belongs to a different prompt than this request's "
                   "(the prefill and decode requests were paired wrongly)")


def _transfer_key(parsed: RemotePrefill) -> tuple[str, int, str | None]:
    """The samples of one request share their transfer: the same P and the same key on it."""
    return parsed.host, parsed.port, parsed.remote_key or parsed.transfer_id


def _prompt_hash(request: Request) -> str:
    return prompt_hash(request.prompt_token_ids, [(m.offset, m.mm_hash) for m in request.mm_items])


@dataclass(frozen=True, slots=True)
class HoldSpec:
    key: str
    token: str
    block_ids: tuple[int, ...]
    transfer_id: TransferId | None = None
    vllm: bool = False  # mirror blocks, for a vLLM decoder


@dataclass(frozen=True, slots=True)
class ReleaseSpec:
    host: str
    port: int
    key: str
    token: str
    reason: str
    engine_id: str = ""
    vllm: bool = False  # a vLLM producer: freed by its own notification


@dataclass(frozen=True, slots=True)
class WatchSpec:
    host: str
    port: int
    key: str


@dataclass(slots=True)
class PdConnectorMetadata(KVConnectorMetadata):
    holds: list[HoldSpec] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)
    watch: list[WatchSpec] = field(default_factory=list)
    unwatch: list[WatchSpec] = field(default_factory=list)
    push_chunks: list[PushChunk] = field(default_factory=list)  # P: what this step computed for push requests
    push_ended: list[PushEnded] = field(default_factory=list)  # P: push requests that finished
    push_queued: list[TransferId] = field(default_factory=list)  # P: push requests admitted, not yet computed
    pushes: list[PushRegistration] = field(default_factory=list)  # D: blocks to register with a P
    cancel_pushes: list[TransferId] = field(default_factory=list)  # D: transfer ids whose request ended early
    mirror_fills: list[MirrorFill] = field(default_factory=list)  # P: prefills a vLLM decoder will read


@dataclass(frozen=True, slots=True)
class ProducerIdentity:
    """What a producer puts in its answer so a consumer can find it."""

    engine_id: str
    host: str
    port: int  # side-channel port, known once the agent has bound it


class PdConnectorScheduler(KVConnectorScheduler):
    def __init__(self, block_size: int, load_timeout_s: float = 60.0, load_failure_policy: str = "recompute",
                 mirror: MirrorPlan | None = None) -> None:
        self.block_size, self.load_timeout_s, self.load_failure_policy = block_size, load_timeout_s, load_failure_policy
        self.identity: ProducerIdentity | None = None
        self.mirror = mirror  # a vLLM decoder's view of this producer's KV, when vLLM's side channel is on
        self.vllm_identity: ProducerIdentity | None = None  # that side channel
        self._parsed: dict[ReqId, RemoteDecode | RemotePrefill] = {}
        self._hashes: dict[ReqId, str] = {}  # the prompt each transferring request's KV belongs to
        # n > 1 on a decode instance: the first sample (the leader) loads the prompt's KV once; the others wait
        # for it, then find the prompt's blocks in the prefix cache.
        self._leaders: dict[tuple[str, int, str | None], Request] = {}
        self._followers: dict[ReqId, Request] = {}
        self._pending: PdConnectorMetadata = PdConnectorMetadata()
        self._allocated: set[ReqId] = set()  # consumer requests whose load was planned
        self._loading: set[ReqId] = set()  # loads handed to the worker and not finished
        self._errors: dict[ReqId, str] = {}

    # -- admission ------------------------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        parsed = request.kv_transfer_params  # parsed and validated where the server read the request
        if parsed is None:
            return
        if isinstance(parsed, RemoteDecode) and parsed.transfer_id is None and self.mirror is not None:
            parsed = replace(parsed, vllm=True)  # vLLM's own proxies (push needs a transfer_id): vLLM D reads it
        if isinstance(parsed, RemotePrefill):
            leader = self._leaders.get(_transfer_key(parsed))
            if leader is not None and not leader.is_finished:
                self._followers[request.request_id] = leader
                return
            self._leaders[_transfer_key(parsed)] = request
        self._parsed[request.request_id] = parsed
        self._hashes[request.request_id] = _prompt_hash(request)
        if isinstance(parsed, RemoteDecode) and parsed.push and parsed.transfer_id is not None:
            self._pending.push_queued.append(parsed.transfer_id)
        if isinstance(parsed, RemotePrefill) and parsed.mode == "pull":  # vLLM's lease outlasts a prompt's load
            self._pending.watch.append(WatchSpec(parsed.host, parsed.port, parsed.remote_key))

    def take_request_errors(self) -> dict[ReqId, str]:
        errors, self._errors = self._errors, {}
        return errors

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        leader = self._followers.get(request.request_id)
        if leader is not None:
            loading = leader.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if not leader.is_finished and (loading or leader.num_computed_tokens < leader.num_prompt_tokens - 1):
                return None, False  # the prompt's KV is not in this instance yet: wait for the leader
            del self._followers[request.request_id]
            return 0, False  # from here on an ordinary request: its prompt is in the prefix cache
        parsed = self._parsed.get(request.request_id)
        if not isinstance(parsed, RemotePrefill) or request.request_id in self._allocated:
            return 0, False
        if parsed.prompt_hash is not None and parsed.prompt_hash != self._hashes.get(request.request_id):
            return self._refuse_other_prompt(request, parsed)
        if parsed.mode == "pull" and len(parsed.block_ids) < cdiv(request.num_prompt_tokens, self.block_size):
            self._errors[request.request_id] = (
                f"the remote KV covers {len(parsed.block_ids)} blocks but the prompt needs "
                f"{cdiv(request.num_prompt_tokens, self.block_size)}: P and D saw different prompts")
            return None, False
        remaining = request.num_prompt_tokens - num_computed_tokens
        return (remaining, True) if remaining > 0 else (0, False)

    def _refuse_other_prompt(self, request: Request, parsed: RemotePrefill) -> tuple[int | None, bool]:
        """P's KV is another prompt's: never load it. P frees it now; this request computes its own prompt
        (recompute) or ends with a clear error (fail)."""
        rid = request.request_id
        del self._parsed[rid]
        self._forget_leader(request, parsed)
        self._pending.unwatch.append(WatchSpec(parsed.host, parsed.port, parsed.remote_key))
        self._release(parsed, "the decode request's prompt differs from the transfer's")
        if self.load_failure_policy == "fail":
            self._errors[rid] = PROMPT_MISMATCH
            return None, False
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        parsed = self._parsed.get(request.request_id)
        if not isinstance(parsed, RemotePrefill) or request.request_id in self._allocated:
            return
        self._allocated.add(request.request_id)
        if num_external_tokens == 0:
            # Everything was found locally: P only needs to hear that it can free its copy.
            self._release(parsed, "prompt fully cached on the decode instance")
            return
        first = (request.num_prompt_tokens - num_external_tokens) // self.block_size
        if parsed.mode == "push":
            needed = block_ids[first:cdiv(request.num_prompt_tokens, self.block_size)]
            self._pending.pushes.append(PushRegistration(
                request_id=request.request_id, transfer_id=parsed.transfer_id, host=parsed.host,
                port=parsed.port, engine_id=parsed.engine_id, first_block=first, block_ids=tuple(needed),
                num_tokens=request.num_prompt_tokens, token=secrets.token_hex(16),
                prompt_hash=self._hashes.get(request.request_id, "")))
            return
        if parsed.mode == VLLM_NIXL:
            self._pending.loads.append(LoadJob(
                request_id=request.request_id, host=parsed.host, port=parsed.port, engine_id=parsed.engine_id,
                key=parsed.remote_key, token="", remote_block_ids=parsed.block_ids,
                local_block_ids=tuple(block_ids[first:cdiv(request.num_prompt_tokens, self.block_size)]),
                deadline_s=self.load_timeout_s, vllm=True, first_token=first * self.block_size,
                num_tokens=request.num_prompt_tokens))
            return
        remote = parsed.block_ids[first:cdiv(request.num_prompt_tokens, self.block_size)]
        self._pending.loads.append(LoadJob(
            request_id=request.request_id, host=parsed.host, port=parsed.port, engine_id=parsed.engine_id,
            key=parsed.remote_key, token=parsed.token or "", remote_block_ids=tuple(remote),
            local_block_ids=tuple(block_ids[first:first + len(remote)]), deadline_s=self.load_timeout_s))
        if parsed.cached_tokens is not None:
            # Report P's own prefix-cache hits, not D's near-total "hit" on transferred blocks (as vLLM does).
            request.num_cached_tokens = parsed.cached_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PdConnectorMetadata:
        meta, self._pending = self._pending, PdConnectorMetadata()
        self._loading.update(job.request_id for job in meta.loads)
        self._loading.update(push.request_id for push in meta.pushes)
        for item in scheduler_output.scheduled:
            parsed = self._parsed.get(item.request_id)
            if isinstance(parsed, RemoteDecode) and parsed.vllm and self.mirror is not None:
                fill = self.mirror.plan_fill(item)
                if fill is not None:
                    meta.mirror_fills.append(fill)
            elif isinstance(parsed, RemoteDecode) and parsed.push:
                meta.push_chunks.append(PushChunk(
                    item.request_id, parsed.transfer_id, tuple(item.block_ids), item.start_position,
                    item.start_position + len(item.token_ids), last=item.sample,
                    prompt_hash=self._hashes.get(item.request_id, "")))
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._loading.difference_update(output.finished_recving)
        if self.mirror is not None:
            for rid in output.finished_sending:  # read by vLLM (or its lease ran out)
                self.mirror.free(rid)

    def has_pending_work(self) -> bool:
        p = self._pending
        return bool(self._loading or p.holds or p.loads or p.releases or p.watch or p.unwatch or p.push_ended
                    or p.pushes or p.cancel_pushes or (self.mirror is not None and self.mirror.num_held()))

    # -- endings --------------------------------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KVHandOff | None]:
        rid = request.request_id
        self._followers.pop(rid, None)
        parsed = self._parsed.pop(rid, None)
        hashed = self._hashes.pop(rid, "")
        self._forget_leader(request, parsed)
        was_planned = rid in self._allocated
        self._allocated.discard(rid)
        if isinstance(parsed, RemoteDecode):
            if parsed.vllm:
                return self._hand_off_vllm(request, parsed)
            if parsed.push:
                return self._push_ended(request, block_ids, parsed, hashed)
            return self._hand_off(request, block_ids, parsed, hashed)
        if isinstance(parsed, RemotePrefill) and parsed.mode == "push":
            return self._push_consumer_ended(request, parsed, was_planned)
        if not isinstance(parsed, RemotePrefill):
            return False, None
        self._pending.unwatch.append(WatchSpec(parsed.host, parsed.port, parsed.remote_key))
        if rid in self._loading:
            # Ended mid-read: P may free at once, but our blocks wait until the read is over (vLLM's P is told
            # by the read itself).
            if parsed.mode != VLLM_NIXL:
                self._release(parsed, "decode request ended while loading")
            return True, None
        unsent = [job for job in self._pending.loads if job.request_id == rid]
        if unsent:
            # The load was planned but not handed over: drop it, or it would write into freed blocks.
            self._pending.loads = [job for job in self._pending.loads if job.request_id != rid]
        if unsent or not was_planned:
            self._release(parsed, "decode request ended before its KV was loaded")
        return False, None

    def _hand_off(self, request: Request, block_ids: list[int], parsed: RemoteDecode, hashed: str
                  ) -> tuple[bool, RemotePrefill | None]:
        if request.status not in _HANDOFF_STATUSES or not block_ids or self.identity is None:
            return False, None
        num_blocks = cdiv(request.num_prompt_tokens, self.block_size)
        held = tuple(block_ids[:num_blocks])
        token = secrets.token_hex(16)
        self._pending.holds.append(HoldSpec(request.request_id, token, held, parsed.transfer_id))
        return True, RemotePrefill(
            engine_id=self.identity.engine_id, host=self.identity.host, port=self.identity.port,
            remote_key=request.request_id, block_ids=held, token=token, transfer_id=parsed.transfer_id, mode="pull",
            num_tokens=request.num_prompt_tokens, cached_tokens=max(request.num_cached_tokens, 0), prompt_hash=hashed)

    def _hand_off_vllm(self, request: Request, parsed: RemoteDecode) -> tuple[bool, RemotePrefill | None]:
        """The prompt's KV is in mirror blocks (copied at the step that finished the prefill): hold those for the
        vLLM decoder and free the pool's blocks now. With no mirror room (or no vLLM side channel), hand off
        nothing: the decoder computes the prompt itself."""
        rid = request.request_id
        mirror, identity = self.mirror, self.vllm_identity
        held = mirror.blocks_of(rid) if mirror is not None else ()
        if request.status not in _HANDOFF_STATUSES or not held or identity is None:
            if mirror is not None:
                mirror.free(rid)
            return False, None
        self._pending.holds.append(HoldSpec(rid, "", held, parsed.transfer_id, vllm=True))
        return False, RemotePrefill(engine_id=identity.engine_id, host=identity.host, port=identity.port,
                                    remote_key=rid, block_ids=held, token=None, transfer_id=None, mode=VLLM_NIXL,
                                    num_tokens=request.num_prompt_tokens)

    def _push_ended(self, request: Request, block_ids: list[int], parsed: RemoteDecode, hashed: str
                    ) -> tuple[bool, PushHeld | None]:
        handed_off = request.status in _HANDOFF_STATUSES and bool(block_ids)
        held = tuple(block_ids[:cdiv(request.num_prompt_tokens, self.block_size)])
        self._pending.push_ended.append(PushEnded(request.request_id, parsed.transfer_id, held,
                                                  request.num_prompt_tokens, handed_off, hashed))
        if not handed_off:
            return False, None
        # Held until the push completes, D gives up, or no D registers within the deadline.
        return True, PushHeld(parsed.transfer_id, request.num_prompt_tokens, max(request.num_cached_tokens, 0))

    def _push_consumer_ended(self, request: Request, parsed: RemotePrefill, was_planned: bool
                             ) -> tuple[bool, None]:
        rid = request.request_id
        if rid in self._loading:
            self._pending.cancel_pushes.append(parsed.transfer_id)
            return True, None  # P may be writing into our blocks: keep them until it says it stopped
        unsent = [p for p in self._pending.pushes if p.request_id == rid]
        if unsent:
            self._pending.pushes = [p for p in self._pending.pushes if p.request_id != rid]
        if unsent or not was_planned:
            self._pending.releases.append(ReleaseSpec(parsed.host, parsed.port, parsed.transfer_id, "",
                                                      "decode request ended before registering"))
        return False, None

    def _forget_leader(self, request: Request, parsed: RemoteDecode | RemotePrefill | None) -> None:
        if isinstance(parsed, RemotePrefill) and self._leaders.get(_transfer_key(parsed)) is request:
            del self._leaders[_transfer_key(parsed)]

    def _release(self, parsed: RemotePrefill, reason: str) -> None:
        if parsed.remote_key is not None:
            self._pending.releases.append(ReleaseSpec(parsed.host, parsed.port, parsed.remote_key, parsed.token or "",
                                                      reason, parsed.engine_id, parsed.mode == VLLM_NIXL))


class PdConnectorWorker(KVConnectorWorker):
    """Hands each step's plan to the agent's owners (pull producer and consumer, both ends of push) and
    collects what finished for the engine."""

    def __init__(self, agent: TransferAgent, block_size: int, push_timeout_s: float = 60.0,
                 unregistered_timeout_s: float = 30.0, load_failure_policy: str = "recompute") -> None:
        self.agent = agent
        self.load_failure_policy = load_failure_policy
        self.block_size = block_size
        self.push_timeout_s = push_timeout_s
        self.unregistered_timeout_s = unregistered_timeout_s
        self.translator = TransferMap()
        self.push: PushProducer | None = None
        self.kv: Any = None
        self._meta: PdConnectorMetadata | None = None
        self._failed: set[ReqId] = set()
        self._invalid: set[int] = set()
        self._refused: dict[ReqId, str] = {}
        self._records: dict[ReqId, TransferRecord] = {}

    def register_kv_caches(self, kv_cache: Any) -> None:
        self.kv = kv_cache
        if self.agent.vllm_producer is not None:
            self.agent.vllm_producer.allocate(kv_cache)
        self.attach_pool(kv_cache.shape[1])

    def attach_pool(self, num_layers: int) -> None:
        """The KV cache exists (pdserve's pool, or another engine's cache the data planes already serve)."""
        self.push = PushProducer(self.agent.push_producer, self.translator, self.block_size, num_layers,
                                 self.unregistered_timeout_s)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, PdConnectorMetadata)
        self._meta = metadata
        if self.push is not None:
            self.push.bind(metadata.push_chunks, metadata.push_ended, metadata.push_queued)

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None:
            return
        if self.agent.faults.step_delay():
            time.sleep(self.agent.faults.step_delay())
        pull, leases, pushes = self.agent.pull_consumer, self.agent.pull_producer, self.agent.push_consumer
        for w in meta.watch:
            pull.watch(w.host, w.port, w.key)
        for w in meta.unwatch:
            pull.unwatch(w.host, w.port, w.key)
        for hold in meta.holds:
            leases.hold(hold.key, hold.token, list(hold.block_ids), hold.transfer_id, hold.vllm)
        for job in meta.loads:
            pull.submit(job)
        for registration in meta.pushes:
            self.translator.add(registration.transfer_id, registration.request_id)
            pushes.expect(registration, self.push_timeout_s)
        for transfer_id in meta.cancel_pushes:
            pushes.cancel(transfer_id)
        for r in meta.releases:
            if r.vllm:
                pull.send_vllm_release(r.host, r.port, r.engine_id, r.key)
            else:
                pull.send_release(r.host, r.port, r.key, r.token, r.reason)
        if self.push is not None:
            self.push.start_step()

    def has_pending_work(self) -> bool:
        return self.agent.push_producer.has_work() or (self.push is not None and self.push.has_pending_work())

    def save_kv_layer(self, layer_index: int) -> None:
        if self.push is not None:
            self.push.save_layer(layer_index)

    def wait_for_save(self) -> None:
        if self.push is not None:
            self.push.end_step()
        producer = self.agent.vllm_producer
        if self._meta is not None and self._meta.mirror_fills and producer is not None and self.kv is not None:
            producer.fill(self.kv, self._meta.mirror_fills)

    def get_finished(self, finished_req_ids: set[ReqId]) -> tuple[set[ReqId], set[ReqId]]:
        sending = {ReqId(key) for key in self.agent.pull_producer.take_released()}
        if self.push is not None:
            sending |= self.push.finished_requests()
        recving: set[ReqId] = set()
        for result in self.agent.take_completed():
            recving.add(result.request_id)
            self.translator.remove_request(result.request_id)
            self._invalid.update(result.invalid_blocks)
            self._records[result.request_id] = TransferRecord(result.started_at, result.seconds, result.nbytes,
                                                              result.plane, result.ok)
            if result.fatal:
                self._refused[result.request_id] = f"KV transfer refused by the prefill instance: {result.error}"
            elif result.mismatch and self.load_failure_policy == "fail":
                self._refused[result.request_id] = PROMPT_MISMATCH
            elif not result.ok:
                self._failed.add(result.request_id)
        return sending, recving

    def get_failed_recving(self) -> set[ReqId]:
        failed, self._failed = self._failed, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def get_refused_recving(self) -> dict[ReqId, str]:
        refused, self._refused = self._refused, {}
        return refused

    def get_transfer_records(self) -> dict[ReqId, TransferRecord]:
        records, self._records = self._records, {}
        return records
