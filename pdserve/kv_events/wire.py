"""vLLM's KV-cache events, field for field, and a decoder for every shape vLLM has published them in.

A payload is one msgpack `KVEventBatch`: `[ts, [events...], data_parallel_rank]` (an array, by position). Its events
are tagged maps `{"type": "BlockStored", ...}` since vLLM 0.24; older releases sent positional arrays
`["BlockStored", block_hashes, parent, token_ids, ...]`. vLLM omits fields left at their defaults and has added
fields six times, so the decoder reads both shapes by field name (array positions map to vLLM's declaration
order, which only ever grew at the end), fills what is absent, and ignores what it does not know.

Block hashes are whatever the engine chose: unsigned or signed 64-bit integers (vLLM's default, the low 64 bits
of its digest), or raw digests (bytes). They are only compared with other hashes of the same publisher, after
`engine_key` folds a signed integer onto the unsigned one with the same bits.
"""

from __future__ import annotations

from typing import Any

import msgspec

EngineHash = int | bytes

# vLLM's name for the engine's own KV cache, whatever the device (vLLM-CPU publishes it too); other media
# ("CPU", "STORAGE") are tiers below it: an offload or a shared store.
MEDIUM_DEVICE = "GPU"
MEDIUM_STORAGE = "STORAGE"  # a store shared by instances (pdserve's KV store tier names its blocks with it)
_U64 = (1 << 64) - 1


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Tagged by class name under "type", as vLLM's are."""


class BlockStored(KVCacheEvent):
    # The first seven have no defaults in vLLM: its decoder requires them, so they are always written.
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]  # all tokens of the new full blocks, block after block
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None  # per block: what besides tokens entered its hash (media, salt, LoRA)
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[EngineHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# Declaration order (positional arrays) and the fields vLLM always writes (absent only from foreign publishers).
_FIELDS: dict[str, tuple[type[KVCacheEvent], tuple[str, ...]]] = {
    cls.__name__: (cls, cls.__struct_fields__) for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
_REQUIRED_NONE = {"parent_block_hash", "lora_id", "medium", "lora_name"}

encode_batch = msgspec.msgpack.Encoder().encode
_decode_typed = msgspec.msgpack.Decoder(KVEventBatch).decode
_decode_any = msgspec.msgpack.Decoder().decode


class EventDecodeError(ValueError):
    """A payload that is no KV event batch of any shape vLLM has sent."""


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one published payload, whichever shape its events take; raises EventDecodeError."""
    try:  # vLLM 0.32's and pdserve's shape, decoded in one pass
        return _decode_typed(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    try:
        raw = _decode_any(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from exc
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "events" in raw:
        ts, events, rank = raw.get("ts", 0.0), raw["events"], raw.get("data_parallel_rank")
    else:
        raise EventDecodeError(f"not a KV event batch: {type(raw).__name__}")
    if not isinstance(events, list):
        raise EventDecodeError("the batch's events are not a list")
    try:
        return KVEventBatch(float(ts), [_event(e) for e in events], rank if isinstance(rank, int) else None)
    except (msgspec.ValidationError, TypeError, ValueError) as exc:
        raise EventDecodeError(f"malformed event: {exc}") from exc


def _event(raw: Any) -> Event:
    if isinstance(raw, dict):
        fields = dict(raw)
        name = fields.pop("type", None)
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        name = raw[0]
        known = _FIELDS.get(name, (None, ()))[1]
        fields = dict(zip(known, raw[1:]))
    else:
        raise ValueError(f"an event must be a tagged map or array, got {type(raw).__name__}")
    cls, names = _FIELDS.get(name, (None, ()))
    if cls is None:
        raise ValueError(f"unknown event type {name!r}")
    args = {k: fields.get(k) for k in names if k in fields or k in _REQUIRED_NONE}
    return msgspec.convert(args, cls)


def engine_key(block_hash: EngineHash) -> EngineHash:
    """One key per hash value: a signed 64-bit integer names the same block as the unsigned one with its bits."""
    return block_hash & _U64 if isinstance(block_hash, int) else bytes(block_hash)
