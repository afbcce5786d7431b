"""What migration puts on the wire: typed, versioned, parsed once where it arrives. No torch: the gateway uses it.

Three conversations carry a running request from one decode instance (the source) to another (the target):

* source → target, `POST /v1/migration/stage`: the KV blocks filled so far, stage by stage, each readable once
  under a lease of the source's (its key and read token, as a pull's), bound to the token ids whose KV they hold;
  the last stage (`final`) carries the request as it stopped, and the target goes on with it;
* instance → gateway, at the end of a stream: a `Handoff` when the copy starts (the gateway reattaches to the
  source with a `Continue` of phase `window`, so it knows every token its client was sent), a `HandedOver` when
  the target took the request (the gateway attaches to the target). A stream ends with the marker line
  `pdserve-migration: {...}` and no blank line after it; a JSON answer comes as status `MOVED_STATUS` with the
  marker as its body. Both end an answer, so a gateway looks for them once per leg, never per token.
* gateway → instance: `kv_transfer_params: {"migration": Continue}` on the client's own body.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.sampling_params import SamplingParams

VERSION = 1
MARKER = b"pdserve-migration: "
TOKENS = b"pdserve-tokens: "  # a window leg's line before each event: the ids of the tokens it carries
MOVED_STATUS = 307  # a JSON answer that goes on elsewhere: its body is the marker
SPLICE_HEADER = b"x-pdserve-splice"  # sent by a gateway that splices a migrated request's stream
CONTINUE_HEADER = b"x-pdserve-continue"  # on a gateway's leg after a marker: no new work, a request going on
MODES = ("live", "stop-copy", "recompute")  # multi-stage copy; stop, copy all, resume; the target recomputes
PHASES = ("window", "attach", "resume")
MIGRATING = "migrating"  # the finish reason of a leg that ends because its request starts to move (it runs on)


class MigrationError(ValueError):
    """A migration message or call that cannot be taken: `status` is the HTTP status that says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class MovedOn(Exception):
    """A request answered with a marker instead of its end: the gateway goes on where the marker says."""

    def __init__(self, body: bytes) -> None:
        super().__init__("moved on")
        self.body = body


class Logprob(msgspec.Struct, array_like=True):
    """One sampled token's logprob and its top alternatives (an engine TokenLogprobs, without the engine)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


class RequestState(msgspec.Struct, kw_only=True):
    """A request as it stopped on the source, enough for the target to go on exactly: its tokens, sampling
    parameters and the random stream of a seeded request (None: greedy, unseeded or nothing drawn yet)."""

    request_id: str = ""  # the client-visible one, which names the request's timeline
    external_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logprobs: list[Logprob] = []
    sampling: SamplingParams
    num_cached_tokens: int = 0
    generator_state: bytes | None = None


class Source(msgspec.Struct, frozen=True):
    """The source's side channel, where the target reads the blocks (the engine id it must have)."""

    engine_id: str
    host: str
    port: int


class CopyStage(msgspec.Struct, kw_only=True):
    version: int = VERSION
    migration_id: str
    token: str  # the migration's capability: the same on every message of it, and on the gateway's attach
    source: Source
    key: str  # the source's lease on this stage's blocks
    read_token: str
    first_block: int  # blocks before it came in earlier stages
    block_ids: list[int]  # the source's blocks first_block, first_block + 1, ...
    token_ids: list[int]  # the sequence whose KV the blocks hold, from its start
    final: RequestState | None = None  # the handover: the source stopped the request, and the target runs it


class StageReply(msgspec.Struct):
    ok: bool
    error: str = ""


class Abandon(msgspec.Struct):
    version: int = VERSION
    migration_id: str = ""
    token: str = ""
    reason: str = ""


class TargetStatus(msgspec.Struct, kw_only=True):
    """`GET /v1/migration` on a would-be target: whether it takes migrations, and what its KV is."""

    version: int = VERSION
    accepting: bool
    reason: str = ""
    engine_id: str
    role: str
    model: str
    compat_hash: str
    layout: str = ""  # what its KV is, in words (model, dtype, block size), for a refusal to name


class MigrateRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/migrate` on a source: move one request (by the client's request id) or `count` of them."""

    request_id: str | None = None
    to: str | None = None  # the target's URL; None: whichever the gateway relaying the request picks
    count: int = 1
    mode: str = "live"
    # With `count`: move only requests holding at most this share of the source's KV cache (a rebalancer moving
    # at most half the gap between two instances never makes the other one the busier).
    max_share: float = 1.0
    # The pace of a live move's bulk copy in MiB/s (None: the source's configured pace; 0: unpaced).
    max_mib_per_s: float | None = None


class MigrateResult(msgspec.Struct, kw_only=True):
    request_id: str
    outcome: str  # handed_over, no_target, failed, finished_first
    to: str | None = None
    error: str = ""
    stop_s: float = 0.0  # how long the request was stopped on the source for the handover
    stages: int = 0


class Handoff(msgspec.Struct, tag="handoff", kw_only=True):
    """A source starts moving a request: reattach for the window (phase `window`), `to` the target it names."""

    version: int = VERSION
    migration_id: str
    token: str
    to: str | None
    mode: str
    cursor: int  # outputs this stream sent
    output_token_ids: list[int]  # every output so far: what a recompute elsewhere goes on from
    logprobs: list[Logprob] = []
    num_cached_tokens: int = 0


class HandedOver(msgspec.Struct, tag="handed_over", kw_only=True):
    """The request goes on at `to`: attach there (or, `recompute`, resume there from the tokens sent)."""

    version: int = VERSION
    migration_id: str
    token: str
    to: str
    recompute: bool = False
    output_token_ids: list[int] = []  # with `recompute`: every output so far
    logprobs: list[Logprob] = []


Marker = Handoff | HandedOver


class Continue(msgspec.Struct, kw_only=True):
    """The gateway's leg after a marker, in `kv_transfer_params.migration`: `cursor` outputs reached the client
    already (0 for a JSON answer, which comes whole from the last leg)."""

    version: int = VERSION
    phase: str
    migration_id: str = ""
    token: str = ""
    cursor: int = 0
    to: str | None = None  # window: the target the gateway chose (None: the request finishes on the source)
    output_token_ids: list[int] = []  # resume: the outputs to go on from
    logprobs: list[Logprob] = []
    num_cached_tokens: int = 0


_marker_decoder = msgspec.json.Decoder(Marker)
_continue_decoder = msgspec.json.Decoder(Continue)


def encode(message: msgspec.Struct) -> bytes:
    return msgspec.json.encode(message)


def decode_marker(raw: bytes) -> Marker:
    """A marker from the end of a stream (after MARKER) or a MOVED_STATUS body."""
    try:
        marker = _marker_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise MigrationError(502, f"unreadable migration marker: {exc}") from exc
    if marker.version != VERSION:
        raise MigrationError(502, f"migration marker version {marker.version}, expected {VERSION}")
    return marker


def parse_continue(params: Any) -> Continue | None:
    """The migration part of a body's kv_transfer_params, or None when it has none."""
    if not isinstance(params, dict) or "migration" not in params:
        return None
    try:
        cont = msgspec.convert(params["migration"], Continue)
    except msgspec.ValidationError as exc:
        raise MigrationError(400, f"kv_transfer_params.migration: {exc}") from exc
    if cont.version != VERSION or cont.phase not in PHASES or cont.cursor < 0:
        raise MigrationError(400, f"kv_transfer_params.migration: unsupported version {cont.version} or phase "
                                  f"{cont.phase!r}, or a negative cursor")
    return cont


def with_continue(body: dict[str, Any], cont: Continue) -> bytes:
    """The client's body for a leg after a marker."""
    return msgspec.json.encode({**body, "kv_transfer_params": {"migration": cont}})


def decode_as(raw: bytes, kind: type) -> Any:
    try:
        message = msgspec.json.decode(raw, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MigrationError(400, f"malformed {kind.__name__}: {exc}") from exc
    if getattr(message, "version", VERSION) != VERSION:
        raise MigrationError(400, f"{kind.__name__} version {message.version}, expected {VERSION}")
    return message
