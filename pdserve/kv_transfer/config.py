"""`--kv-transfer-config` (vLLM's shape) and the `--role` shorthand, resolved into one role and one dict."""

from __future__ import annotations

from typing import Any

KV_ROLE_OF = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both", "encode": "kv_both"}
ROLE_OF = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


class TransferConfigError(ValueError):
    pass


def resolve_transfer_config(role: str | None, kv_config: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """Returns (instance role, kv transfer config). The two flags must not contradict each other."""
    kv_config = dict(kv_config or {})
    kv_role = kv_config.get("kv_role")
    if kv_role is not None and kv_role not in ROLE_OF:
        raise TransferConfigError(f"unknown kv_role {kv_role!r}; use kv_producer, kv_consumer or kv_both")
    if role is None:
        role = ROLE_OF.get(kv_role, "both")
    elif kv_role is not None and role != "encode" and ROLE_OF[kv_role] != role and kv_role != "kv_both":
        raise TransferConfigError(f"--role {role} contradicts kv_role {kv_role}")
    if role in ("prefill", "decode") or kv_config:
        kv_config.setdefault("kv_role", KV_ROLE_OF[role])
    return role, kv_config
