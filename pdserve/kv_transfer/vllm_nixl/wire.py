"""vLLM NixlConnector's wire format (vLLM 0.32, connector version 14), written from its field names.

The handshake on P's side channel is one ZMQ request, msgpack ``(b"get_meta_msg", pp_rank, tp_rank)``, answered
with two frames: msgpack ``{compatibility_hash, agent_metadata_bytes}`` and P's clock. ``agent_metadata_bytes``
is msgpack of the agent metadata below (a map keyed by field name). After reading a request's blocks, the reader
tells P with a NIXL notification ``"<remote_request_id>:<number of readers>"``, and P frees them.

vLLM's compatibility hash is a SHA-256 of a JSON object of factors that include vLLM's own version, so it is
also how the version is checked: the factors are recomputed here for every known release, and only a hash that
matches a 0.32.x release with this model's shape is accepted. A hash that matches another release names it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import msgspec

GET_META_MSG = b"get_meta_msg"
CONNECTOR_VERSION = 14  # the connector version vLLM 0.32 reports; its metadata schema is the one below
SUPPORTED_SERIES = "0.32"
DEFAULT_RELEASE = "0.32.0"  # the release a pdserve producer answers as, unless told another 0.32.x
# Releases recognised by name in a refusal (a hash is one-way: an unknown release only reads as "incompatible").
_KNOWN_SERIES = tuple(f"0.{minor}" for minor in range(28, 40))
_PATCHES = range(10)


class HandshakePayload(msgspec.Struct):
    compatibility_hash: str
    agent_metadata_bytes: bytes


class AgentMetadata(msgspec.Struct):
    """What a vLLM worker publishes about its KV memory: one region per layer, ``num_blocks`` blocks each.

    The fields vLLM's decoder requires, and the optional ones read here; it adds per-region details this
    layout does not need (decoding ignores them)."""

    engine_id: str
    agent_metadata: bytes  # the NIXL agent's own blob, for add_remote_agent
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    dcp_size: int = 1
    pcp_size: int = 1


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The factors of vLLM's compatibility hash that describe the model (``model`` as vLLM was started with)."""

    model: str
    dtype: str  # torch's name, e.g. "torch.float32"
    num_kv_heads: int
    head_size: int
    num_layers: int


def compatibility_hash(shape: ModelShape, vllm_version: str, attn_backend: str, hybrid_kv: bool) -> str:
    factors = {
        "vllm_version": vllm_version, "nixl_connector_version": CONNECTOR_VERSION, "model": shape.model,
        "dtype": shape.dtype, "num_kv_heads": shape.num_kv_heads, "head_size": shape.head_size,
        "num_hidden_layers": shape.num_layers, "attn_backend_name": attn_backend, "cache_dtype": "auto",
        "is_hma_enabled": hybrid_kv, "speculative_config": None, "transfer_mode": "pull",
    }
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


class VersionRefused(ValueError):
    """P is not a vLLM release (or configuration) this instance exchanges KV with."""


def identify_release(shape: ModelShape, attn_backend: str, remote_hash: str) -> str:
    """The vLLM release whose hash P sent, if it is a supported one; raises VersionRefused otherwise."""
    for series in (SUPPORTED_SERIES, *(s for s in _KNOWN_SERIES if s != SUPPORTED_SERIES)):
        for patch in _PATCHES:
            version = f"{series}.{patch}"
            for hybrid_kv in (True, False):
                if compatibility_hash(shape, version, attn_backend, hybrid_kv) == remote_hash:
                    if series != SUPPORTED_SERIES:
                        raise VersionRefused(f"the prefill instance runs vLLM {version}; pdserve exchanges KV only "
                                             f"with vLLM {SUPPORTED_SERIES}.x")
                    return version
    raise VersionRefused(
        f"the prefill instance's NIXL compatibility hash matches no vLLM {SUPPORTED_SERIES}.x serving {shape.model} "
        f"({shape.dtype}, {shape.num_layers} layers, {shape.num_kv_heads} KV heads of {shape.head_size}, "
        f"{attn_backend}): another vLLM version, model or configuration")


def handshake_frames(shape: ModelShape, release: str, meta: AgentMetadata, clock: float) -> list[bytes]:
    """A producer's answer to vLLM's handshake request: the payload (hashed as vLLM `release` with its default
    hybrid KV manager computes it for this model) and the producer's clock."""
    if not release.startswith(SUPPORTED_SERIES + "."):
        raise VersionRefused(f"pdserve answers vLLM's handshake only as vLLM {SUPPORTED_SERIES}.x, not {release}")
    payload = HandshakePayload(compatibility_hash(shape, release, meta.attn_backend_name, True),
                               msgspec.msgpack.encode(meta))
    return [msgspec.msgpack.encode(payload), msgspec.msgpack.encode(clock)]


def read_done(remote_request_id: str, readers: int = 1) -> bytes:
    """The notification that tells vLLM P its blocks for this request were read and may be freed."""
    return f"{remote_request_id}:{readers}".encode()
