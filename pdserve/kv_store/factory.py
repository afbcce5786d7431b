"""Building the store tier from a kv_transfer_config, and putting its halves beside another connector's."""

from __future__ import annotations

from typing import Any

import torch

from pdserve.kv_store.chain import ChainScheduler, ChainWorker
from pdserve.kv_store.config import store_config
from pdserve.kv_store.connector import StoreConnectorScheduler, StoreConnectorWorker
from pdserve.kv_store.keys import Namespace
from pdserve.kv_store.tier import KVStoreTier
from pdserve.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker


def store_entry(kv_cfg: dict[str, Any], extra: dict[str, Any]) -> Any:
    """`kv_store` at the top of pdserve's kv_transfer_config, or in its extra config (where vLLM's must put it)."""
    if "kv_store" in kv_cfg and "kv_store" in extra:
        raise ValueError("kv_store is given twice: at the top of kv_transfer_config and in kv_connector_extra_config")
    return kv_cfg.get("kv_store", extra.get("kv_store"))


def namespace_for(model: str, dtype: torch.dtype, block_size: int, num_layers: int, kv_heads: int,
                  head_dim: int) -> Namespace:
    """`model`: the weights' fingerprint, or the model's name where there are no local weights to fingerprint."""
    return Namespace(model=model, dtype=str(dtype), block_size=block_size, num_layers=num_layers, kv_heads=kv_heads,
                     head_dim=head_dim, itemsize=torch.empty((), dtype=dtype).element_size())


def build_store(raw: Any, namespace: Namespace) -> KVStoreTier | None:
    config = store_config(raw)
    if config is None:
        return None
    tier = KVStoreTier(config, namespace)
    tier.connect_soon()
    return tier


def chain_scheduler(scheduler: KVConnectorScheduler, tier: KVStoreTier) -> ChainScheduler:
    """The engine's scheduler half: `scheduler` first, the store's beside it."""
    return ChainScheduler(scheduler, StoreConnectorScheduler(tier, tier.namespace.block_size))


def chain_worker(worker: KVConnectorWorker, tier: KVStoreTier) -> ChainWorker:
    return ChainWorker(worker, StoreConnectorWorker(tier))
