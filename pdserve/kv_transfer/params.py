"""`kv_transfer_params`, the one typed contract between clients, the gateway and instances.

Fields as vLLM's NIXL connector shapes them: a prefill leg carries ``{"do_remote_decode": true}``; P answers with
the params a decode leg needs: ``do_remote_prefill``, ``remote_block_ids`` (a list per KV group),
``remote_engine_id``, ``remote_request_id`` (P's own internal id), ``remote_host``, ``remote_port`` (P's side
channel) and ``tp_size``. pdserve adds ``transfer_id`` (the gateway's, shared by every leg), ``transfer_token``
(the read capability), ``transfer_mode`` (pull or push), ``remote_num_tokens``, ``remote_prefill_cached_tokens``,
``remote_prompt_hash`` (which prompt the KV belongs to) and, for decode-first, ``remote_prefill_url``; a prefill leg
may ask with ``hand_off: "vllm-nixl"`` for vLLM's own shape (a vLLM decode instance pulls). Routers pass unknown
keys through.

A body's dict is parsed here once, where the server reads the request, and only these types travel below that.
Each type writes its own wire dict (`to_wire`), so every producer of the wire form (the instance's answers, the
gateway's legs, the decode-first client) writes the same keys in the same order. This module imports no torch:
the gateway uses it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.ids import MAX_REMOTE_REQUEST_ID_LENGTH, TransferId


# RemotePrefill.mode of KV held by a vLLM NixlConnector producer, loaded with vLLM's own protocol.
VLLM_NIXL = "vllm-nixl"


class KVParamsError(ValueError):
    """Unusable kv_transfer_params; the server answers 400."""


def prompt_hash(token_ids: Iterable[int], mm_hashes: Iterable[tuple[int, str]] = ()) -> str:
    """Names the prompt a transfer's KV belongs to: its token ids and its media items (offset, mm_hash), since
    two prompts with the same placeholder tokens but different images have different KV. Producer and consumer
    each compute it from their own request; a transfer between different prompts is refused."""
    return hashlib.blake2b(msgspec.msgpack.encode([list(token_ids), list(mm_hashes)]), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class RemoteDecode:
    """This instance prefills and holds the KV for a decode instance to take (pull) or writes it there (push)."""

    transfer_id: TransferId | None
    push: bool = False
    # Hand the KV off in vLLM NixlConnector's shape (a vLLM decode instance pulls it): asked for by a gateway
    # pairing this P with a vLLM D, or implied by a prefill request without a transfer_id (vLLM's own proxies).
    vllm: bool = False

    def to_wire(self) -> dict[str, Any]:
        """The prefill leg's params (the gateway's, or a decode-first D's)."""
        wire: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": self.transfer_id}
        if self.push:
            wire["transfer_mode"] = "push"
        if self.vllm:
            wire["hand_off"] = VLLM_NIXL
        return wire


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """This instance decodes; the prompt's KV is on the instance named here."""

    engine_id: str
    host: str
    port: int
    remote_key: str | None  # P's request id (pull); None in push mode, where the transfer_id is the key
    block_ids: tuple[int, ...] | None  # pull mode; None in push mode
    token: str | None
    transfer_id: TransferId | None
    mode: str  # "pull", "push", or VLLM_NIXL (pull from a vLLM NixlConnector producer)
    num_tokens: int | None = None
    cached_tokens: int | None = None  # P's own prefix-cache hits, which D reports as the request's cached tokens
    prompt_hash: str | None = None  # `prompt_hash` of the prompt whose KV P holds (pull); None: not told

    def to_wire(self) -> dict[str, Any]:
        """Pull: what P answers after holding the KV. Push: what the gateway sends D (P's side channel). vLLM's
        shape: exactly the fields vLLM 0.32's NixlConnector hands out, nothing of pdserve's."""
        if self.mode == VLLM_NIXL:
            return {"do_remote_prefill": True, "do_remote_decode": False,
                    "remote_block_ids": [list(self.block_ids or ())], "remote_engine_id": self.engine_id,
                    "remote_request_id": self.remote_key, "remote_host": self.host, "remote_port": self.port,
                    "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": self.num_tokens,
                    "remote_blocks_expiry_time": None, "transfer_mode": "pull"}
        if self.mode == "push":
            return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push",
                    "transfer_id": self.transfer_id, "remote_engine_id": self.engine_id,
                    "remote_host": self.host, "remote_port": self.port}
        wire: dict[str, Any] = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [list(self.block_ids or ())], "remote_engine_id": self.engine_id,
            "remote_request_id": self.remote_key, "remote_host": self.host, "remote_port": self.port, "tp_size": 1,
            "transfer_token": self.token, "remote_num_tokens": self.num_tokens, "transfer_mode": "pull",
            "remote_prefill_cached_tokens": self.cached_tokens,
        }
        if self.transfer_id is not None:
            wire["transfer_id"] = self.transfer_id
        if self.prompt_hash is not None:
            wire["remote_prompt_hash"] = self.prompt_hash
        return wire


@dataclass(frozen=True, slots=True)
class PushHeld:
    """P's answer to a push-mode prefill: the KV stays held until the push completes, D gives up, or no D
    registers within the deadline. Informational (D was told where P is by the gateway), so never parsed back."""

    transfer_id: TransferId
    num_tokens: int
    cached_tokens: int

    def to_wire(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": self.transfer_id,
                "transfer_mode": "push", "remote_num_tokens": self.num_tokens,
                "remote_prefill_cached_tokens": self.cached_tokens}


@dataclass(frozen=True, slots=True)
class DecodeFirst:
    """Decode-first mode: this (decode) instance must ask the prefill instance at `prefill_url` itself."""

    prefill_url: str
    transfer_id: TransferId | None

    def to_wire(self) -> dict[str, Any]:
        """The decode leg's params: D is told only where P is."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_prefill_url": self.prefill_url,
                "transfer_id": self.transfer_id}


@dataclass(frozen=True, slots=True)
class ForeignPrefill:
    """Remote-prefill parameters that are not pdserve's: vLLM NIXL's, say, which carry no transfer token (push:
    no transfer id). Their side channel speaks another protocol, where one unexpected message can break it, so a
    pdserve consumer never dials it with pdserve's messages. An instance configured to load vLLM's KV does so
    from `prefill` (vLLM's own handshake and notification); any other prefills locally (policy `recompute`) or
    refuses the request (`fail`)."""

    engine_id: str | None
    why: str
    prefill: RemotePrefill | None = None  # the fields as vLLM's NixlConnector (pull) sent them


@dataclass(frozen=True, slots=True)
class KVRelease:
    """`POST /v1/kv/release` on a producer: held KV named by (remote_request_id, transfer_token) or transfer_id."""

    key: str | None
    token: str
    transfer_id: TransferId | None


# What a request may carry into an instance, and what a finished request hands back to its client.
KVTransferParams = RemoteDecode | RemotePrefill | DecodeFirst | ForeignPrefill
KVHandOff = RemotePrefill | PushHeld


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


# Names, hosts, tokens and ids the gateway mints are short; 256 characters is plenty for them.
MAX_PARAM_CHARS = 256


def _text(params: dict[str, Any], key: str, required: bool = True, limit: int = MAX_PARAM_CHARS) -> str | None:
    value = params.get(key)
    if value is None:
        if required:
            raise KVParamsError(f"kv_transfer_params.{key} is missing")
        return None
    if not isinstance(value, str) or not value or len(value) > limit:
        raise KVParamsError(f"kv_transfer_params.{key} must be a non-empty string of at most {limit} characters")
    return value


def _transfer_id(params: dict[str, Any]) -> TransferId | None:
    value = _text(params, "transfer_id", required=False)
    return None if value is None else TransferId(value)


def _port(params: dict[str, Any]) -> int:
    port = params.get("remote_port")
    if isinstance(port, str) and port.isdigit():
        port = int(port)  # some proxies send it as a string
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise KVParamsError("kv_transfer_params.remote_port must be a TCP port number")
    return port


def parse_kv_params(params: Any, max_blocks: int) -> KVTransferParams | None:
    """None for an ordinary request; raises KVParamsError for anything malformed."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise KVParamsError("kv_transfer_params must be a JSON object")
    remote_decode = params.get("do_remote_decode") is True
    remote_prefill = params.get("do_remote_prefill") is True
    if remote_decode and remote_prefill:
        raise KVParamsError("kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill")
    transfer_id = _transfer_id(params)
    if remote_decode:
        push = params.get("transfer_mode") == "push"
        if push and transfer_id is None:
            raise KVParamsError("push mode needs the gateway's transfer_id in kv_transfer_params")
        hand_off = params.get("hand_off")
        if hand_off not in (None, VLLM_NIXL):
            raise KVParamsError(f"kv_transfer_params.hand_off must be {VLLM_NIXL!r} when given")
        if push and hand_off is not None:
            raise KVParamsError("a vLLM NixlConnector decode instance pulls: hand_off excludes push mode")
        return RemoteDecode(transfer_id, push, vllm=hand_off is not None)
    if not remote_prefill:
        return None
    if "remote_prefill_url" in params:
        url = _text(params, "remote_prefill_url")
        if not url.startswith("http://"):
            raise KVParamsError("kv_transfer_params.remote_prefill_url must be an http:// URL")
        return DecodeFirst(url.rstrip("/"), transfer_id)
    prefill = _remote_prefill(params, transfer_id, max_blocks)
    if prefill.mode == "pull" and not prefill.token:
        # pdserve's producers hand out a transfer token with every pull: well-formed block ids without one were
        # handed out by another engine (vLLM NIXL's shape), whose side channel this instance must never dial.
        return ForeignPrefill(prefill.engine_id, "no pdserve transfer_token", prefill)
    return prefill



def _remote_prefill(params: dict[str, Any], transfer_id: TransferId | None, max_blocks: int) -> RemotePrefill:
    tp_size = params.get("tp_size", 1)
    if tp_size not in (1, None):
        raise KVParamsError(f"tp_size {tp_size} is not supported (pdserve instances have one KV shard)")
    block_ids = params.get("remote_block_ids")
    mode = "pull" if block_ids is not None else "push"
    num_tokens = params.get("remote_num_tokens")
    if num_tokens is not None and (not isinstance(num_tokens, int) or num_tokens < 0):
        raise KVParamsError("kv_transfer_params.remote_num_tokens must be a non-negative integer")
    cached = params.get("remote_prefill_cached_tokens")  # informational: a malformed value is ignored
    return RemotePrefill(
        engine_id=_text(params, "remote_engine_id"),
        host=_text(params, "remote_host"),
        port=_port(params),
        remote_key=_text(params, "remote_request_id", required=mode == "pull", limit=MAX_REMOTE_REQUEST_ID_LENGTH),
        block_ids=_flat_block_ids(block_ids, max_blocks) if mode == "pull" else None,
        token=_text(params, "transfer_token", required=False),
        transfer_id=transfer_id,
        mode=mode,
        num_tokens=num_tokens,
        cached_tokens=cached if isinstance(cached, int) else None,
        prompt_hash=_text(params, "remote_prompt_hash", required=False),
    )


def parse_release(body: Any) -> KVRelease:
    """A release names its KV by P's request id (with the token P handed out) or by the gateway's transfer id."""
    params = body if isinstance(body, dict) else {}
    key = params.get("remote_request_id")
    transfer_id = params.get("transfer_id")
    if not isinstance(key, str) and not isinstance(transfer_id, str):
        raise KVParamsError("a release names remote_request_id (with transfer_token) or transfer_id")
    return KVRelease(key if isinstance(key, str) else None, str(params.get("transfer_token") or ""),
                     TransferId(transfer_id) if isinstance(transfer_id, str) else None)
