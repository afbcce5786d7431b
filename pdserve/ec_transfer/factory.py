"""`--ec-transfer-config` (vLLM's shape) into an EC connector: the registry of EC connectors lives here.

    {"ec_connector": "ECStorageConnector" | "ECP2PConnector", "ec_role": "ec_producer" | "ec_consumer" | "ec_both",
     "ec_load_failure_policy": "recompute" | "fail",
     "ec_connector_extra_config": {"shared_storage_path": ..., "port": ..., "ttl": ..., "fault_injection": {...}}}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdserve.ec_transfer.base import ECConnector
from pdserve.ec_transfer.p2p import ECP2PConnector
from pdserve.ec_transfer.storage import ECStorageConnector
from pdserve.kv_transfer.faults import FaultConfig

EC_ROLES = ("ec_producer", "ec_consumer", "ec_both")


def _storage(extra: dict[str, Any], faults: FaultConfig, engine_id: str) -> ECConnector:
    return ECStorageConnector(extra.get("shared_storage_path", "/tmp"), faults)


def _p2p(extra: dict[str, Any], faults: FaultConfig, engine_id: str) -> ECConnector:
    return ECP2PConnector(host=extra.get("host", "127.0.0.1"), port=int(extra.get("port", 0)), engine_id=engine_id,
                          max_bytes=int(extra.get("max_bytes", 1 << 30)), ttl_s=float(extra.get("ttl", 600.0)),
                          fetch_timeout_s=float(extra.get("fetch_timeout", 5.0)), faults=faults)


EC_CONNECTORS: dict[str, Callable[[dict[str, Any], FaultConfig, str], ECConnector]] = {
    "ECStorageConnector": _storage,
    "ECExampleConnector": _storage,  # vLLM's name for the same layout
    "ECP2PConnector": _p2p,
}


def build_ec_connector(config: dict[str, Any], engine_id: str = "") -> ECConnector | None:
    if not config:
        return None
    name = config.get("ec_connector", "ECStorageConnector")
    builder = EC_CONNECTORS.get(name)
    if builder is None:
        raise ValueError(f"unknown ec_connector {name!r}; available: {', '.join(sorted(EC_CONNECTORS))}")
    role = config.get("ec_role", "ec_consumer")
    if role not in EC_ROLES:
        raise ValueError(f"unknown ec_role {role!r}; use one of {', '.join(EC_ROLES)}")
    extra = dict(config.get("ec_connector_extra_config") or {})
    return builder(extra, FaultConfig.from_dict(extra.get("fault_injection")), engine_id)


def ec_policy(config: dict[str, Any]) -> str:
    policy = (config or {}).get("ec_load_failure_policy", "recompute")
    if policy not in ("recompute", "fail"):
        raise ValueError(f"ec_load_failure_policy must be recompute or fail, got {policy!r}")
    return policy
