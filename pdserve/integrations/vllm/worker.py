"""The worker side of PdConnector inside vLLM: vLLM's KV cache (a tensor per layer) served by pdserve's transfer
agent and `PdConnectorWorker`, the same code a pdserve instance runs.

The agent starts when vLLM registers its KV cache: only then are there bytes to serve and a layout to name in
the compatibility hash. Bytes move opaquely per (block, layer) between ends that lay the cache out alike: the
hash covers vLLM's version, the model, the layers' names, shapes and dtype, and the block size. A pdserve
instance lays the same model's KV out otherwise; the handshake's layout identity (vLLM-CPU's, with the weights'
fingerprint) lets either end regroup the other's blocks when it reads them (`kv_transfer/layouts.py`).

On a GPU (CUDA vLLM) the cache is device memory, which only the nixl plane moves without a host copy: NIXL
registers each layer's tensor as VRAM and moves blocks per (block, layer); checksums run on the device
(`kv_transfer/integrity.py`); shm and tcp refuse the cache at registration, and "auto" serves nixl alone. The
hash then names the device type, and no layout identity is sent, so a GPU instance pairs only with GPU instances
laid out alike and never regroups with a host one. This path is written but has never run on a GPU: unverified.

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
from pdserve.integrations.vllm.settings import Settings, model_fingerprint, store_tier
from pdserve.kv_store.blocks import VllmCpuBlocks, check_geometry
from pdserve.kv_store.factory import chain_worker
from pdserve.kv_store.metrics import store_metric_values
from pdserve.kv_store.tier import KVStoreTier
from pdserve.kv_transfer.agent import TransferAgent
from pdserve.kv_transfer.base import KVConnectorMetadata as PdserveMetadata
from pdserve.kv_transfer.base import KVConnectorWorker
from pdserve.kv_transfer.data_plane import DATA_PLANES, NIXL_INSTALL_HINT, make_data_plane
from pdserve.kv_transfer.data_plane.regions import BlockRegions
from pdserve.kv_transfer.factory import agent_config, connector_halves
from pdserve.kv_transfer.layouts import vllm_cpu_layout
from pdserve.kv_transfer.messages import PROTOCOL_VERSION
from pdserve.kv_transfer.metrics import transfer_metric_values
from pdserve.kv_transfer.pd_connector import PdConnectorWorker

# Inside vLLM the cache is vLLM's memory (a tensor per layer), served over the planes that address any layout's
# blocks per layer: shm by cross-memory attach (one host), tcp copies their bytes, NIXL registers each layer's
# tensor once. "auto" serves every installed one; for device memory, the one that moves it without a host copy.
PLANES = ("shm", "tcp", "nixl")
DEVICE_PLANES = ("nixl",)


def plane_names(preferred: str, device: torch.device) -> list[str]:
    """The planes to serve the cache over: the one configured (which refuses memory it cannot move), or under
    "auto" every installed one that can move memory on `device`."""
    if preferred not in ("auto", *PLANES):
        raise ValueError(f"inside vLLM PdConnector serves the {', '.join(PLANES)} data plane, not {preferred}")
    if preferred != "auto":
        return [preferred]
    usable = PLANES if device.type == "cpu" else DEVICE_PLANES
    names = [name for name in usable if name in DATA_PLANES]
    if not names:
        raise ValueError(f"a KV cache on {device} needs the nixl data plane, whose engine is not installed: "
                         f"{NIXL_INSTALL_HINT}")
    return names


def vllm_compat_hash(settings: Settings, vllm_version: str, kv_caches: dict[str, torch.Tensor]) -> str:
    layers = [[name, list(t.shape), str(t.dtype)] for name, t in kv_caches.items()]
    identity = {"protocol": PROTOCOL_VERSION, "engine": f"vllm {vllm_version}", "model": settings.model,
                "block_size": settings.block_size, "layout": "vllm: a tensor per layer, copied opaquely",
                "layers": layers}
    device = next(iter(kv_caches.values())).device
    if device.type != "cpu":  # host caches keep the hash they always had; a device's never equals one
        identity["device"] = device.type
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


class VllmWorkerSide:
    def __init__(self, settings: Settings, vllm_config: Any = None) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.agent: TransferAgent | None = None
        self.half: PdConnectorWorker | None = None
        self.steps: KVConnectorWorker | None = None  # the half, or the half beside the store tier's
        self.store: KVStoreTier | None = None
        self._reported: dict[str, float] = {}
        self._layers: dict[str, int] = {}
        self._device = torch.device("cpu")

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], vllm_version: str) -> None:
        """Serve vLLM's cache. A CUDA cache takes the device path (VRAM registered with NIXL, checksums on the
        device), which is written but has never run on a GPU: unverified."""
        s = self.settings
        regions = BlockRegions.from_layers(list(kv_caches.values()))
        self._device = regions.device
        self._layers = {name: index for index, name in enumerate(kv_caches)}
        names = plane_names(str(s.extra.get("data_plane", "auto")), regions.device)
        planes = {name: make_data_plane(name, s.host) for name in names}
        for plane in planes.values():
            plane.attach_regions(regions)
        config = agent_config(s.kv_cfg, s.extra, s.engine_id, vllm_compat_hash(s, vllm_version, kv_caches), planes)
        caches = tuple(kv_caches.values())
        if caches[0].device.type == "cpu":  # vLLM-CPU's layout; on other devices copies stay opaque
            config.layout = vllm_cpu_layout(caches, s.block_size, model_fingerprint(s.model))
            config.layer_caches = caches
        self.agent = TransferAgent(config)
        _, self.half = connector_halves(self.agent, s.block_size, s.policy)
        self.half.attach_pool(regions.num_layers)
        self.steps = self._with_store(self.half, caches)
        self.agent.start()

    def _with_store(self, half: PdConnectorWorker, caches: tuple[torch.Tensor, ...]) -> KVConnectorWorker:
        """The store tier's worker half beside PdConnector's, reading and writing vLLM-CPU's cache regrouped into
        the stored layout (a GPU cache has no host layout to regroup: not supported there)."""
        store = store_tier(self.vllm_config, self.settings)
        if store is None:
            return half
        if caches[0].device.type != "cpu":
            store.close()
            raise ValueError("kv_store inside vLLM serves a KV cache in host memory (vLLM-CPU)")
        blocks = VllmCpuBlocks(caches, store.namespace)
        check_geometry(store.namespace, caches[0][0].numel() * caches[0].element_size() * len(caches), len(caches))
        self.store = store
        chain = chain_worker(half, self.store)
        chain.store.attach(blocks)
        return chain

    def bind(self, meta: PdserveMetadata) -> None:
        if self.steps is not None:
            self.steps.bind_connector_metadata(meta)
            self.steps.start_load_kv()

    def clear(self) -> None:
        if self.steps is not None:
            self.steps.clear_connector_metadata()

    def save_kv_layer(self, layer_name: str) -> None:
        """The layer's KV for this step is in the cache: push writes it to D now, while later layers compute."""
        if self.half is None:
            return
        push = self.half.push
        if self._device.type == "cuda" and push is not None and push.writes_this_step():
            # The layer's kernels may still be queued: NIXL reads the memory outside vLLM's stream, so the writes
            # wait for them (this costs push steps the overlap of layers; steps without writes keep it).
            torch.cuda.current_stream(self._device).synchronize()
        self.half.save_kv_layer(self._layers[layer_name])

    def wait_for_save(self) -> None:
        if self.steps is not None:
            self.steps.wait_for_save()

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(sent: blocks P may free, received: loads that ended, failed: loads vLLM's policy must handle).

        A load the producer refused as never granted (a forged or replayed capability) is a failed load here:
        nothing was copied, and vLLM's kv_load_failure_policy decides (recompute, or fail the request).
        """
        if self.steps is None:
            return set(), set(), set()
        sending, recving = self.steps.get_finished({ReqId(r) for r in finished_req_ids})
        failed = self.steps.get_failed_recving() | set(self.steps.get_refused_recving())
        self.steps.get_transfer_records()  # pdserve's engine times transfers from these; vLLM has its own timings
        return set(sending), set(recving), set(failed)

    def changed_metrics(self) -> dict[str, float] | None:
        """Every transfer metric's value, when any changed since the last call (vLLM ships them with a step)."""
        if self.agent is None or self.half is None:
            return None
        values = transfer_metric_values(self.agent, self.half)
        if self.store is not None:
            values.update(store_metric_values(self.store.stats))
        if values == self._reported:
            return None
        self._reported = values
        return values

    def load_errors(self) -> set[int]:
        return self.steps.get_block_ids_with_load_errors() if self.steps is not None else set()

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.stop()
            self.agent = None
        if self.store is not None:
            self.store.close()
            self.store = None
