"""The scheduler side of PdConnector inside vLLM: vLLM's calls onto pdserve's `PdConnectorScheduler`.

What vLLM's scheduler lacks is bridged here and only here: request views (vLLM's requests under pdserve's
names), the step's schedule in pdserve's shape (push plans its writes from it), decode-first's ask of P while
vLLM keeps the request waiting, refusing a transfer by computing the prompt locally (vLLM cannot end a request
from a connector), and keeping vLLM's engine stepping while P holds KV, since held blocks go back to vLLM only at
a step, and while the store tier's writes are in flight, since their counts reach /metrics only with a step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pdserve.engine.outputs import KVConnectorOutput
from pdserve.ids import ReqId
from pdserve.integrations.vllm.decode_first import DecodeFirstAsks
from pdserve.integrations.vllm.requests import RequestView, parse_vllm_params
from pdserve.integrations.vllm.schedule import PushSchedule
from pdserve.integrations.vllm.settings import Settings, store_tier
from pdserve.kv_store.chain import ChainMetadata
from pdserve.kv_store.factory import chain_scheduler
from pdserve.kv_transfer.base import KVConnectorMetadata, KVConnectorScheduler
from pdserve.kv_transfer.params import DecodeFirst, RemoteDecode
from pdserve.kv_transfer.pd_connector import PdConnectorScheduler, ProducerIdentity
from pdserve.kv_transfer.peer_policy import PeerPolicy

log = logging.getLogger(__name__)
_WRITE_WAIT_S = 30.0  # how long vLLM keeps stepping for store writes the worker has not reported ended
# The worker's counters whose sum is every store write it ended (taken, refused or dropped).
_WRITES_ENDED = ("pdserve:kv_store_blocks_written", "pdserve:kv_store_write_refused", "pdserve:kv_store_writes_dropped")


class StoreWritesInFlight:
    """Store writes planned here against those the worker's stats say ended. An idle vLLM steps no more, and
    the worker's counters ride on steps: without this, a write that ends after the request's last step would
    show on /metrics only once another request runs."""

    def __init__(self) -> None:
        self.planned = 0
        self.ended = 0
        self.last_planned_at = 0.0

    def plan(self, meta: KVConnectorMetadata) -> None:
        if isinstance(meta, ChainMetadata) and meta.store.writes:
            self.planned += len(meta.store.writes)
            self.last_planned_at = time.monotonic()

    def observe(self, output: Any) -> None:
        data = getattr(getattr(output, "kv_connector_stats", None), "data", None)
        if data and all(name in data for name in _WRITES_ENDED):
            self.ended = int(sum(data[name] for name in _WRITES_ENDED))

    def pending(self) -> bool:
        return self.planned > self.ended and time.monotonic() - self.last_planned_at < _WRITE_WAIT_S


class VllmSchedulerSide:
    def __init__(self, settings: Settings, vllm_config: Any = None) -> None:
        self.settings = settings
        self.pd = PdConnectorScheduler(settings.block_size, load_timeout_s=float(
            settings.extra.get("kv_load_timeout", 60.0)), load_failure_policy=settings.policy)
        self.pd.identity = ProducerIdentity(settings.engine_id, settings.host, settings.port)
        # The store tier's lookups are the scheduler's (its own client); its loads and writes the worker's.
        store = store_tier(vllm_config, settings)
        self.half: KVConnectorScheduler = chain_scheduler(self.pd, store) if store is not None else self.pd
        self._views: dict[str, RequestView] = {}
        self._held: set[str] = set()  # P: finished requests whose blocks wait for D's read or push, or a release
        self._schedule = PushSchedule()
        self._asks = DecodeFirstAsks(PeerPolicy.from_config(settings.extra.get("allowed_peers")), settings.max_blocks)
        self._abandoned: dict[str, RequestView] = {}  # D: ended while P was asked; P's answer must be freed
        self._writes = StoreWritesInFlight()

    def on_new_request(self, request: Any) -> None:
        params = parse_vllm_params(request.kv_transfer_params, self.settings.max_blocks)
        view = self._views[request.request_id] = RequestView(request, params)
        if isinstance(params, DecodeFirst):
            # The half sees the request once P has answered, as the pull it then is (or an ordinary request).
            view.kv_transfer_params = None
            self._asks.ask(request.request_id, params, list(view.prompt_token_ids))
            return
        self.half.on_new_request(view)

    def _answered(self, view: RequestView) -> bool:
        """Decode-first: whether P has answered (or failed to); its answer becomes the request's params."""
        answered, params = self._asks.take(view.request_id)
        if answered and params is not None:
            view.kv_transfer_params = params
            self.half.on_new_request(view)
        return answered

    def _view(self, request: Any) -> RequestView:
        view = self._views.get(request.request_id)
        if view is None:  # a request added before this connector saw it: an ordinary one
            view = self._views[request.request_id] = RequestView(request, None)
        return view

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        view = self._view(request)
        if self._asks.pending(view.request_id) and not self._answered(view):
            return None, False  # vLLM asks again at its next step and schedules others meanwhile
        matched = self.half.get_num_new_matched_tokens(view, num_computed_tokens)
        errors = self.half.take_request_errors()
        if view.request_id in errors:
            # Unusable remote KV (another prompt's, too few blocks): P frees it now and vLLM computes the prompt.
            log.warning("request %s: %s; its prompt is computed here", request.request_id, errors[view.request_id])
            self.half.request_finished(view, [])
            return 0, False
        return matched

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        self.half.update_state_after_alloc(self._view(request), block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._free_abandoned()
        meta = self.half.build_connector_meta(self._schedule.scheduler_output(scheduler_output, self._step_tokens))
        self._writes.plan(meta)
        return meta

    def _step_tokens(self, request_id: str) -> list[int] | None:
        """The tokens whose chunks the half plans from: a pushing request's prompt, every request's tokens when
        the store writes them."""
        view = self._views.get(request_id)
        if view is None:
            return None
        params = view.kv_transfer_params
        if isinstance(params, RemoteDecode) and params.push:
            return view.prompt_token_ids
        return view.token_ids_range(0, view.num_tokens) if self.half is not self.pd else None

    def _free_abandoned(self) -> None:
        """P answered a request that ended meanwhile: as a pull never planned, the half tells P to free it."""
        for rid in self._asks.answered():
            view = self._abandoned.pop(rid, None)
            if view is not None and self._answered(view) and view.kv_transfer_params is not None:
                self.half.request_finished(view, [])

    def update_connector_output(self, output: Any) -> None:
        """vLLM frees the blocks of each id in `output.finished_sending` right after this, asserting it still holds
        that request: an id it does not hold would kill the engine core. The worker reports only hand-offs vLLM was
        told to hold, once; should any other id come, vLLM never sees it and a warning names it."""
        self._writes.observe(output)
        sending = set(output.finished_sending or ())
        stray = sending - self._held
        if stray:
            log.warning("PdConnector: sending reported finished for %d request(s) vLLM does not hold (%s); kept "
                        "back from vLLM", len(stray), ", ".join(sorted(stray)[:3]))
        ready = sending & self._held
        self._held.difference_update(ready)
        output.finished_sending = ready
        recving = set(output.finished_recving or ())
        self.half.update_connector_output(KVConnectorOutput(finished_recving={ReqId(r) for r in recving}))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        view = self._views.pop(request.request_id, None) or RequestView(request, None)
        self._schedule.forget(request.request_id)
        if self._asks.pending(view.request_id):
            self._abandoned[view.request_id] = view
            return False, None
        delay, params = self.half.request_finished(view, block_ids)
        if delay and params is not None:  # P's hand-off (pull or push): blocks held until finished_sending
            self._held.add(request.request_id)
        return delay, (params.to_wire() if params is not None else None)

    def has_pending_work(self) -> bool:
        return bool(self._held or self._abandoned) or self.half.has_pending_work() or self._writes.pending()

    def shutdown(self) -> None:
        self._asks.close()
