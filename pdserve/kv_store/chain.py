"""The store tier beside another connector (PdConnector), as one connector to the engine, as vLLM's
MultiConnector joins connectors: the other connector is asked first, the store only for requests the other
leaves to be computed here, and each half sees only its own part of the step's metadata.

A request's external tokens belong to whichever half offered them; the other half is told it gets none. Both
halves see every request's blocks allocated, every step and every ending, so a prefill instance's requests read
from and write to the store while its own connector hands their KV to a decoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.engine.outputs import KVConnectorOutput, SchedulerOutput, TransferRecord
from pdserve.ids import ReqId
from pdserve.kv_store.connector import StoreConnectorScheduler, StoreConnectorWorker
from pdserve.kv_transfer.base import KVConnectorMetadata, KVConnectorScheduler, KVConnectorWorker
from pdserve.kv_transfer.params import KVHandOff


@dataclass(slots=True)
class ChainMetadata(KVConnectorMetadata):
    first: KVConnectorMetadata
    store: KVConnectorMetadata


class ChainScheduler(KVConnectorScheduler):
    def __init__(self, first: KVConnectorScheduler, store: StoreConnectorScheduler) -> None:
        self.first = first
        self.store = store
        self._store_owned: set[ReqId] = set()  # requests whose external tokens the store offered

    def on_new_request(self, request: Any) -> None:
        self.first.on_new_request(request)
        self.store.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        matched, load_async = self.first.get_num_new_matched_tokens(request, num_computed_tokens)
        if matched is None or matched > 0 or load_async:
            self._store_owned.discard(request.request_id)
            return matched, load_async
        matched, load_async = self.store.get_num_new_matched_tokens(request, num_computed_tokens)
        if matched:
            self._store_owned.add(request.request_id)
        return matched, load_async

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        store = request.request_id in self._store_owned
        self.first.update_state_after_alloc(request, block_ids, 0 if store else num_external_tokens)
        self.store.update_state_after_alloc(request, block_ids, num_external_tokens if store else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ChainMetadata:
        return ChainMetadata(self.first.build_connector_meta(scheduler_output),
                             self.store.build_connector_meta(scheduler_output))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.first.update_connector_output(output)
        self.store.update_connector_output(output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, KVHandOff | None]:
        self._store_owned.discard(request.request_id)
        held, params = self.first.request_finished(request, block_ids)
        store_held, _ = self.store.request_finished(request, block_ids)
        return held or store_held, params

    def has_pending_work(self) -> bool:
        return self.first.has_pending_work() or self.store.has_pending_work()

    def take_request_errors(self) -> dict[ReqId, str]:
        return self.first.take_request_errors()

    def shutdown(self) -> None:
        self.first.shutdown()
        self.store.shutdown()


class ChainWorker(KVConnectorWorker):
    def __init__(self, first: KVConnectorWorker, store: StoreConnectorWorker) -> None:
        self.first = first
        self.store = store

    def register_kv_caches(self, kv_cache: Any) -> None:
        self.first.register_kv_caches(kv_cache)
        self.store.register_kv_caches(kv_cache)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, ChainMetadata)
        self.first.bind_connector_metadata(metadata.first)
        self.store.bind_connector_metadata(metadata.store)

    def clear_connector_metadata(self) -> None:
        self.first.clear_connector_metadata()
        self.store.clear_connector_metadata()

    def start_load_kv(self) -> None:
        self.first.start_load_kv()
        self.store.start_load_kv()

    def wait_for_layer_load(self, layer_index: int) -> None:
        self.first.wait_for_layer_load(layer_index)

    def save_kv_layer(self, layer_index: int) -> None:
        self.first.save_kv_layer(layer_index)

    def wait_for_save(self) -> None:
        self.first.wait_for_save()
        self.store.wait_for_save()

    def get_finished(self, finished_req_ids: set[ReqId]) -> tuple[set[ReqId], set[ReqId]]:
        sending, recving = self.first.get_finished(finished_req_ids)
        _, stored = self.store.get_finished(finished_req_ids)
        return sending, recving | stored

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.first.get_block_ids_with_load_errors() | self.store.get_block_ids_with_load_errors()

    def has_pending_work(self) -> bool:
        return self.first.has_pending_work() or self.store.has_pending_work()

    def get_failed_recving(self) -> set[ReqId]:
        return self.first.get_failed_recving()

    def get_refused_recving(self) -> dict[ReqId, str]:
        return self.first.get_refused_recving()

    def get_transfer_records(self) -> dict[ReqId, TransferRecord]:
        return {**self.first.get_transfer_records(), **self.store.get_transfer_records()}

    def shutdown(self) -> None:
        self.first.shutdown()
        self.store.shutdown()
