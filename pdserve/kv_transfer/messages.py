"""Side-channel messages: typed, tagged and versioned (msgpack over ZMQ).

Everything that crosses instances is keyed by a transfer key: P's own request id in vLLM-compatible pull mode
(returned to the client as ``remote_request_id``), or the gateway's ``transfer_id`` in push mode. Each held
transfer also carries a random token, a capability that must accompany every read, write or release.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.ids import TransferId

PROTOCOL_VERSION = 1


class Message(msgspec.Struct, tag_field="type", tag=True, kw_only=True):
    version: int = PROTOCOL_VERSION


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """What a block's bytes mean, so a reader whose cache is laid out otherwise can regroup them: who laid them
    out (`engine`: "pdserve" or "vllm-cpu"), how keys are stored ("token-major" or "dim-major"), the block size,
    each layer's part of one block (shape and dtype), the layer count, and the model (a weights fingerprint)."""

    engine: str
    key_layout: str
    block_size: int
    layer_shape: list[int]
    dtype: str
    num_layers: int
    model: str


class Handshake(Message, tag="handshake"):
    engine_id: str
    compat_hash: str
    layout: KVLayout | None = None  # absent from peers that copy only opaquely


class HandshakeReply(Message, tag="handshake_reply"):
    ok: bool
    engine_id: str
    compat_hash: str = ""
    layout: KVLayout | None = None
    data_plane_info: dict[str, Any] = {}
    error: str = ""


class ReadGrant(Message, tag="read_grant"):
    """D asks P to confirm (and pin) the blocks it is about to read for one transfer."""

    key: str
    token: str
    block_ids: list[int]
    prompt_hash: str = ""  # the sequence the reader expects the blocks to hold (leases bound to one check it)


class ReadGrantReply(Message, tag="read_grant_reply"):
    ok: bool
    error: str = ""
    # Why a read was refused: "expired" (a lease ran out: the consumer may recompute) or "denied" (the
    # parameters name KV this consumer was never granted: the request must fail).
    refusal: str = ""
    checksums: list[int] = []  # xxh3-64 of each granted block, in the order asked


class ReadDone(Message, tag="read_done"):
    key: str
    token: str


class Release(Message, tag="release"):
    """Free a transfer's blocks now (the consumer aborted, rejected the request, or gave up)."""

    key: str
    token: str = ""
    reason: str = ""


class Heartbeat(Message, tag="heartbeat"):
    keys: list[str]


class Ack(Message, tag="ack"):
    ok: bool = True
    error: str = ""
    unknown_keys: list[str] = []  # of the keys a Heartbeat or Release named, those no hold exists for


class PushRegister(Message, tag="push_register"):
    """Push mode: D's blocks for a transfer, so P can write each layer into them as it is computed."""

    transfer_id: TransferId
    block_ids: list[int]  # the consumer's blocks for the prompt's blocks first_block, first_block + 1, ...
    first_block: int  # blocks before this one the consumer already has (its own prefix-cache hit)
    num_tokens: int
    consumer_engine_id: str
    consumer_host: str
    consumer_port: int
    token: str
    prompt_hash: str = ""  # the consumer's prompt; empty from a consumer that does not say


class WriteDone(Message, tag="write_done"):
    transfer_id: TransferId
    token: str
    ok: bool = True
    error: str = ""
    checksums: list[int] = []  # of the producer's blocks, in registration order, once all writes landed
    # "denied": the producer never had this transfer (forged or stale parameters); "prompt_mismatch": its KV
    # belongs to another prompt (the consumer recomputes or fails, as its kv_load_failure_policy says).
    refusal: str = ""


class ECFetch(Message, tag="ec_fetch"):
    """Ask an encode instance for one item's encoder output."""

    mm_hash: str
    token: str


class ECData(Message, tag="ec_data"):
    ok: bool
    error: str = ""
    shape: list[int] = []
    dtype: str = ""
    data: bytes = b""
    checksum: int = 0


AnyMessage = (Handshake | HandshakeReply | ReadGrant | ReadGrantReply | ReadDone | Release | Heartbeat | Ack
              | PushRegister | WriteDone | ECFetch | ECData)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


class ProtocolError(ValueError):
    pass


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    try:
        message = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable side-channel message: {exc}") from exc
    if message.version != PROTOCOL_VERSION:
        raise ProtocolError(f"side-channel protocol version {message.version}, expected {PROTOCOL_VERSION}")
    return message
