"""PdConnector's settings inside vLLM, read from vLLM's config the same way on every side (scheduler, worker,
the API server's metrics), so each side names the same engine and side channel without asking the others."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.kv_store.factory import build_store, namespace_for, store_entry
from pdserve.kv_store.tier import KVStoreTier
from pdserve.kv_transfer.factory import extra_config, side_channel_address, weight_fingerprint
from pdserve.utils import cdiv

# What this connector serves inside vLLM; the gateway reads it from the info metric.
PROTOCOLS = ("pull", "push", "decode-first")


@dataclass(frozen=True, slots=True)
class Settings:
    kv_cfg: dict[str, Any]  # pdserve's kv_transfer_config keys, taken from vLLM's
    extra: dict[str, Any]
    engine_id: str
    host: str
    port: int
    block_size: int
    max_blocks: int
    policy: str
    model: str


def model_fingerprint(model: str) -> str:
    """The weights' fingerprint pdserve instances name in their layout, when vLLM serves a local folder ("" else:
    such an instance exchanges KV only with vLLM instances like it)."""
    path = Path(model)
    return weight_fingerprint(path) if path.is_dir() else ""


def read_settings(vllm_config: Any) -> Settings:
    kv = vllm_config.kv_transfer_config
    kv_cfg = {"kv_ip": getattr(kv, "kv_ip", "127.0.0.1"), "kv_port": kv.kv_port, "engine_id": kv.engine_id,
              "kv_connector_extra_config": dict(kv.kv_connector_extra_config or {}),
              "kv_load_failure_policy": getattr(kv, "kv_load_failure_policy", "recompute")}
    extra = extra_config(kv_cfg)
    host, port = side_channel_address(kv_cfg, extra)
    if not port:
        # The scheduler half names the side channel in its answers before the worker half has bound it.
        raise ValueError("PdConnector inside vLLM needs a fixed side channel port: "
                         "kv_connector_extra_config.side_channel_port (or kv_port)")
    block_size = int(vllm_config.cache_config.block_size)
    return Settings(kv_cfg=kv_cfg, extra=extra, engine_id=str(kv.engine_id), host=host, port=port,
                    block_size=block_size, max_blocks=cdiv(int(vllm_config.model_config.max_model_len), block_size),
                    policy=str(kv_cfg["kv_load_failure_policy"]), model=str(vllm_config.model_config.model))


def store_tier(vllm_config: Any, settings: Settings) -> KVStoreTier | None:
    """The store tier's client for one side of the connector (None without `kv_store`). Its namespace is what this
    instance's blocks are: the same model (its weights' fingerprint), dtype and block size as a pdserve instance's
    give the same namespace, so the two share stored prefixes."""
    raw = store_entry(settings.kv_cfg, settings.extra)
    if raw is None:
        return None
    if settings.policy != "recompute":
        raise ValueError("kv_store inside vLLM needs \"kv_load_failure_policy\": \"recompute\" (vLLM's default is "
                         "fail): a stored block that turns out damaged, expired or evicted must be computed, not "
                         "fail its request")
    model, cache = vllm_config.model_config, vllm_config.cache_config
    if cache.cache_dtype != "auto":
        raise ValueError(f"kv_store needs an unquantized KV cache; this instance's is {cache.cache_dtype}")
    name = model_fingerprint(settings.model) or f"name:{settings.model}"
    parallel = vllm_config.parallel_config
    return build_store(raw, namespace_for(name, model.dtype, settings.block_size, model.get_num_layers(parallel),
                                          model.get_num_kv_heads(parallel), model.get_head_size()))
