"""The KV connector API: a scheduler half and a worker half joined only by a per-step metadata object.

Method names and meanings follow vLLM v1's KV connector interface (`KVConnectorBase_V1`). The scheduler half
plans (which tokens are remote, what to hold, what to return to the client); the worker half moves bytes. Neither calls the
other: the scheduler half's ``build_connector_meta`` is handed to the worker half each step, and the worker's
results come back through ``KVConnectorOutput``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pdserve.engine.outputs import KVConnectorOutput, SchedulerOutput, TransferRecord
from pdserve.engine.request import Request
from pdserve.ids import ReqId
from pdserve.kv_transfer.params import KVHandOff


class KVConnectorMetadata:
    """Base of the per-step plan a scheduler half hands to its worker half."""


class KVConnectorScheduler(ABC):
    def on_new_request(self, request: Request) -> None:
        """Called when a request is added (e.g. to start lease heartbeats)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond the local prefix hit that can come from elsewhere, and whether loading is async.

        None means 'ask again later'. Must be side-effect free.
        """

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks are allocated: record what to load into them (or what to save from them)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Package this step's work for the worker half and reset per-step state."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker half's results for the step, for bookkeeping."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KVHandOff | None]:
        """Called once at finish, before blocks are freed: (connector keeps the blocks?, params to return)."""

    def has_pending_work(self) -> bool:
        """True while transfers or leases need the engine loop to keep stepping."""
        return False

    def take_request_errors(self) -> dict[ReqId, str]:
        """Requests the connector wants ended with an error (e.g. unusable transfer parameters)."""
        return {}

    def stats(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        pass


class KVConnectorWorker(ABC):
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """One-time registration of the KV cache tensor [num_blocks, num_layers, 2, kv_heads, block_size, dim]."""

    @abstractmethod
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None: ...

    def clear_connector_metadata(self) -> None:
        pass

    def start_load_kv(self) -> None:
        """Start this step's loads (async loads run in the background and report through get_finished)."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        pass

    def save_kv_layer(self, layer_index: int) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[ReqId]) -> tuple[set[ReqId], set[ReqId]]:
        """(requests whose blocks may now be freed on the sending side, requests whose load completed)."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def has_pending_work(self) -> bool:
        """True while transfer work that only a step can move on (e.g. push registrations) is waiting."""
        return False

    def get_failed_recving(self) -> set[ReqId]:
        return set()

    def get_refused_recving(self) -> dict[ReqId, str]:
        """Loads the producer refused as never granted: those requests must fail, whatever the policy."""
        return {}

    def get_transfer_records(self) -> dict[ReqId, TransferRecord]:
        """How the loads that ended since the last call went (timing, bytes, data plane), for timelines."""
        return {}

    def shutdown(self) -> None:
        pass
