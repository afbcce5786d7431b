"""One stored block: a typed, versioned header beside the KV bytes, checked whole before any byte is used.

    b"PDKV" | header length (u32, little-endian) | header (msgpack) | KV bytes

The header binds the bytes to what they mean: the namespace (model, dtype, block size, layout), the parent
block's chained hash and this block's token ids (the same binding the transfer layer has: a hit whose token ids
differ from the prompt's is never used, whatever its key says), when it was written (for the TTL), and an xxh3
checksum of the KV bytes as the data planes checksum blocks. A reader refuses a value that is short, malformed,
of another namespace or prompt, expired or damaged, naming why.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgspec
import xxhash

from pdserve.kv_store.keys import FORMAT_VERSION

MAGIC = b"PDKV"
_LENGTH = struct.Struct("<I")
PREAMBLE = len(MAGIC) + _LENGTH.size


class BlockHeader(msgspec.Struct, array_like=True, frozen=True):
    version: int
    namespace: bytes
    parent: bytes
    token_ids: list[int]
    written_at: float  # seconds since the epoch: instances on other hosts compare it against their own clock
    nbytes: int
    checksum: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(BlockHeader)


class Refused(ValueError):
    """A stored value that must not be used; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# Why a value was refused, as the refusal metric labels it.
REASONS = ("missing", "truncated", "malformed", "namespace", "tokens", "checksum", "expired")


@dataclass(frozen=True, slots=True)
class Expected:
    """What a block read for a prompt must be."""

    namespace: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    nbytes: int


def encode(namespace: bytes, parent: bytes, token_ids: list[int], kv: memoryview, written_at: float) -> bytes:
    header = _encoder.encode(BlockHeader(FORMAT_VERSION, namespace, parent, list(token_ids), written_at, kv.nbytes,
                                         xxhash.xxh3_64_intdigest(kv)))
    return b"".join((MAGIC, _LENGTH.pack(len(header)), header, kv))


def decode(value: bytes | None, expected: Expected, now: float, ttl_s: float | None) -> memoryview:
    """The KV bytes of `value`, or Refused saying why they must not be used."""
    if not value:
        raise Refused("missing")
    view = memoryview(value)
    if len(view) < PREAMBLE or view[:len(MAGIC)] != MAGIC:
        raise Refused("malformed" if len(view) >= PREAMBLE else "truncated")
    (length,) = _LENGTH.unpack_from(view, len(MAGIC))
    if len(view) < PREAMBLE + length:
        raise Refused("truncated", "the header is cut short")
    try:
        header = _decoder.decode(view[PREAMBLE:PREAMBLE + length])
    except msgspec.DecodeError as exc:
        raise Refused("malformed", str(exc)) from None
    kv = view[PREAMBLE + length:]
    if header.version != FORMAT_VERSION or header.namespace != expected.namespace:
        raise Refused("namespace", "written by another model, dtype, block size, layout or format")
    if header.parent != expected.parent or tuple(header.token_ids) != expected.token_ids:
        raise Refused("tokens", "the stored token ids are not the prompt's")
    if ttl_s is not None and now - header.written_at > ttl_s:
        raise Refused("expired")
    if header.nbytes != expected.nbytes or len(kv) != header.nbytes:
        raise Refused("truncated", f"{len(kv)} KV bytes, {expected.nbytes} expected")
    if xxhash.xxh3_64_intdigest(kv) != header.checksum:
        raise Refused("checksum")
    return kv
