"""The scheduler side of PdConnector inside vLLM: vLLM's calls onto pdserve's `PdConnectorScheduler`.

What vLLM's scheduler lacks is bridged here and only here: request views (vLLM's requests under pdserve's
names), refusing a transfer by computing the prompt locally (vLLM cannot end a request from a connector), and
keeping vLLM's engine stepping while P holds KV, since held blocks go back to vLLM only at a step.
"""

from __future__ import annotations

import logging
from typing import Any

from pdserve.engine.outputs import KVConnectorOutput, SchedulerOutput
from pdserve.ids import ReqId
from pdserve.integrations.vllm.requests import RequestView, parse_vllm_params
from pdserve.integrations.vllm.settings import Settings
from pdserve.kv_transfer.pd_connector import PdConnectorMetadata, PdConnectorScheduler, ProducerIdentity
from pdserve.kv_transfer.params import RemotePrefill

log = logging.getLogger(__name__)


class VllmSchedulerSide:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.half = PdConnectorScheduler(settings.block_size, load_timeout_s=float(
            settings.extra.get("kv_load_timeout", 60.0)), load_failure_policy=settings.policy)
        self.half.identity = ProducerIdentity(settings.engine_id, settings.host, settings.port)
        self._views: dict[str, RequestView] = {}
        self._held: set[str] = set()  # P: finished requests whose blocks wait for D's read or a release

    def on_new_request(self, request: Any) -> None:
        view = RequestView(request, parse_vllm_params(request.kv_transfer_params, self.settings.max_blocks))
        self._views[request.request_id] = view
        self.half.on_new_request(view)

    def _view(self, request: Any) -> RequestView:
        view = self._views.get(request.request_id)
        if view is None:  # a request added before this connector saw it: an ordinary one
            view = self._views[request.request_id] = RequestView(request, None)
        return view

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        view = self._view(request)
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

    def build_connector_meta(self) -> PdConnectorMetadata:
        # Pull needs nothing from the step's schedule (push would: what each step computed).
        return self.half.build_connector_meta(SchedulerOutput())

    def update_connector_output(self, finished_sending: set[str], finished_recving: set[str]) -> None:
        self._held.difference_update(finished_sending)
        self.half.update_connector_output(KVConnectorOutput(finished_recving={ReqId(r) for r in finished_recving}))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        view = self._views.pop(request.request_id, None) or RequestView(request, None)
        delay, params = self.half.request_finished(view, block_ids)
        if delay and isinstance(params, RemotePrefill):
            self._held.add(request.request_id)
        return delay, (params.to_wire() if params is not None else None)

    def has_pending_work(self) -> bool:
        return bool(self._held) or self.half.has_pending_work()
