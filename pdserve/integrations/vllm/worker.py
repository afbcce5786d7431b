"""The worker side of PdConnector inside vLLM: vLLM's KV cache (a tensor per layer) served by pdserve's transfer
agent and `PdConnectorWorker`, the same code a pdserve instance runs.

The agent starts when vLLM registers its KV cache: only then are there bytes to serve and a layout to name in
the compatibility hash. Bytes move opaquely per (block, layer), so both ends must lay the cache out alike: the
hash covers vLLM's version, the model, the layers' names, shapes and dtype, and the block size.

vLLM names layers where pdserve numbers them: a layer's index is its place in the registered cache (the order
the data planes serve it in). vLLM starts a step's loads after the forward; pdserve's half starts the step's
transfer work before it (push must see a registration before the layers it writes are saved), so it does so when
vLLM binds the step's metadata, which precedes the forward.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from pdserve.ids import ReqId
from pdserve.integrations.vllm.settings import Settings
from pdserve.kv_transfer.agent import TransferAgent
from pdserve.kv_transfer.data_plane import make_data_plane
from pdserve.kv_transfer.data_plane.regions import BlockRegions
from pdserve.kv_transfer.factory import agent_config, connector_halves
from pdserve.kv_transfer.messages import PROTOCOL_VERSION
from pdserve.kv_transfer.pd_connector import PdConnectorMetadata, PdConnectorWorker

# Inside vLLM the cache is vLLM's memory, served over the plane that copies any layout's bytes.
PLANES = ("tcp",)


def vllm_compat_hash(settings: Settings, vllm_version: str, kv_caches: dict[str, torch.Tensor]) -> str:
    layers = [[name, list(t.shape), str(t.dtype)] for name, t in kv_caches.items()]
    identity = {"protocol": PROTOCOL_VERSION, "engine": f"vllm {vllm_version}", "model": settings.model,
                "block_size": settings.block_size, "layout": "vllm: a tensor per layer, copied opaquely",
                "layers": layers}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


class VllmWorkerSide:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.agent: TransferAgent | None = None
        self.half: PdConnectorWorker | None = None
        self._layers: dict[str, int] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], vllm_version: str) -> None:
        s = self.settings
        preferred = str(s.extra.get("data_plane", "tcp"))
        if preferred not in ("auto", *PLANES):
            raise ValueError(f"inside vLLM PdConnector serves the {', '.join(PLANES)} data plane, not {preferred}")
        regions = BlockRegions.from_layers(list(kv_caches.values()))
        self._layers = {name: index for index, name in enumerate(kv_caches)}
        planes = {name: make_data_plane(name, s.host) for name in PLANES}
        for plane in planes.values():
            plane.attach_regions(regions)
        config = agent_config(s.kv_cfg, s.extra, s.engine_id, vllm_compat_hash(s, vllm_version, kv_caches), planes)
        self.agent = TransferAgent(config)
        _, self.half = connector_halves(self.agent, s.block_size, s.policy)
        self.half.attach_pool(regions.num_layers)
        self.agent.start()

    def bind(self, meta: PdConnectorMetadata) -> None:
        if self.half is not None:
            self.half.bind_connector_metadata(meta)
            self.half.start_load_kv()

    def clear(self) -> None:
        if self.half is not None:
            self.half.clear_connector_metadata()

    def save_kv_layer(self, layer_name: str) -> None:
        """The layer's KV for this step is in the cache: push writes it to D now, while later layers compute."""
        if self.half is not None:
            self.half.save_kv_layer(self._layers[layer_name])

    def wait_for_save(self) -> None:
        if self.half is not None:
            self.half.wait_for_save()

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(sent: blocks P may free, received: loads that ended, failed: loads vLLM's policy must handle).

        A load the producer refused as never granted (a forged or replayed capability) is a failed load here:
        nothing was copied, and vLLM's kv_load_failure_policy decides (recompute, or fail the request).
        """
        if self.half is None:
            return set(), set(), set()
        sending, recving = self.half.get_finished({ReqId(r) for r in finished_req_ids})
        failed = self.half.get_failed_recving() | set(self.half.get_refused_recving())
        return set(sending), set(recving), set(failed)

    def held(self) -> dict[str, int]:
        """What is held for transfers in flight (HELD_GAUGES): all zero when the instance is idle."""
        if self.agent is None or self.half is None:
            return {}
        return {"pdserve:kv_leases_held": self.agent.num_leases(), "pdserve:kv_push_expected": self.agent.num_expected(),
                "pdserve:kv_transfer_map_size": len(self.half.translator)}

    def load_errors(self) -> set[int]:
        return self.half.get_block_ids_with_load_errors() if self.half is not None else set()

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.stop()
            self.agent = None
