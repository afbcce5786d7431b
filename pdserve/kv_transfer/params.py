"""`kv_transfer_params` as vLLM's NIXL connector shapes them, parsed into typed requests (or a clear error).

A prefill leg carries ``{"do_remote_decode": true}``; P answers with the params a decode leg needs:
``do_remote_prefill``, ``remote_block_ids`` (a list per KV group), ``remote_engine_id``, ``remote_request_id``
(P's own internal id), ``remote_host``, ``remote_port`` (P's side channel) and ``tp_size``. pdserve adds
``transfer_token`` (the read capability) and ``remote_num_tokens``; routers pass unknown keys through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class KVParamsError(ValueError):
    """Unusable kv_transfer_params; the server answers 400."""


@dataclass(frozen=True, slots=True)
class RemoteDecode:
    """This instance prefills and holds the KV for a decode instance to take (pull) or writes it there (push)."""

    transfer_id: str | None
    push: bool = False


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """This instance decodes; the prompt's KV is on the instance named here."""

    engine_id: str
    host: str
    port: int
    remote_key: str | None  # P's request id (pull); None in push mode, where the transfer_id is the key
    block_ids: tuple[int, ...] | None  # pull mode; None in push mode
    token: str | None
    transfer_id: str | None
    mode: str  # "pull" or "push"
    num_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class DecodeFirst:
    """Decode-first mode: this (decode) instance must ask the prefill instance at `prefill_url` itself."""

    prefill_url: str
    transfer_id: str | None


def _flat_block_ids(value: Any, limit: int) -> tuple[int, ...]:
    if isinstance(value, list) and value and all(isinstance(g, list) for g in value):
        if len(value) != 1:
            raise KVParamsError(f"remote_block_ids has {len(value)} KV groups; pdserve models have one")
        value = value[0]
    if not isinstance(value, list):
        raise KVParamsError("remote_block_ids must be a list of block ids (or a list of one such list)")
    if len(value) > limit:
        raise KVParamsError(f"remote_block_ids lists {len(value)} blocks, more than a prompt can use ({limit})")
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in value):
        raise KVParamsError("remote_block_ids must hold non-negative integers")
    return tuple(value)


def _text(params: dict[str, Any], key: str, required: bool = True) -> str | None:
    value = params.get(key)
    if value is None:
        if required:
            raise KVParamsError(f"kv_transfer_params.{key} is missing")
        return None
    if not isinstance(value, str) or not value or len(value) > 256:
        raise KVParamsError(f"kv_transfer_params.{key} must be a non-empty string")
    return value


def _port(params: dict[str, Any]) -> int:
    port = params.get("remote_port")
    if isinstance(port, str) and port.isdigit():
        port = int(port)  # some proxies send it as a string
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise KVParamsError("kv_transfer_params.remote_port must be a TCP port number")
    return port


def parse_kv_params(params: dict[str, Any] | None, max_blocks: int
                    ) -> RemoteDecode | RemotePrefill | DecodeFirst | None:
    """None for an ordinary request; raises KVParamsError for anything malformed."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise KVParamsError("kv_transfer_params must be a JSON object")
    remote_decode = params.get("do_remote_decode") is True
    remote_prefill = params.get("do_remote_prefill") is True
    if remote_decode and remote_prefill:
        raise KVParamsError("kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill")
    transfer_id = _text(params, "transfer_id", required=False)
    if remote_decode:
        push = params.get("transfer_mode") == "push"
        if push and transfer_id is None:
            raise KVParamsError("push mode needs the gateway's transfer_id in kv_transfer_params")
        return RemoteDecode(transfer_id, push)
    if not remote_prefill:
        return None
    if "remote_prefill_url" in params:
        url = _text(params, "remote_prefill_url")
        if not url.startswith("http://"):
            raise KVParamsError("kv_transfer_params.remote_prefill_url must be an http:// URL")
        return DecodeFirst(url.rstrip("/"), transfer_id)
    tp_size = params.get("tp_size", 1)
    if tp_size not in (1, None):
        raise KVParamsError(f"tp_size {tp_size} is not supported (pdserve instances have one KV shard)")
    block_ids = params.get("remote_block_ids")
    mode = "pull" if block_ids is not None else "push"
    if mode == "push" and transfer_id is None:
        raise KVParamsError("kv_transfer_params without remote_block_ids (push mode) need a transfer_id")
    num_tokens = params.get("remote_num_tokens")
    if num_tokens is not None and (not isinstance(num_tokens, int) or num_tokens < 0):
        raise KVParamsError("kv_transfer_params.remote_num_tokens must be a non-negative integer")
    return RemotePrefill(
        engine_id=_text(params, "remote_engine_id"),
        host=_text(params, "remote_host"),
        port=_port(params),
        remote_key=_text(params, "remote_request_id", required=mode == "pull"),
        block_ids=_flat_block_ids(block_ids, max_blocks) if mode == "pull" else None,
        token=_text(params, "transfer_token", required=False),
        transfer_id=transfer_id,
        mode=mode,
        num_tokens=num_tokens,
    )
