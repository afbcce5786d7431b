"""What the scheduler half tells the worker half about push transfers, step by step (connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.ids import ReqId, TransferId


@dataclass(frozen=True, slots=True)
class PushChunk:
    """P: a push request's prefill chunk computed in this step (tokens [start, end))."""

    request_id: ReqId
    transfer_id: TransferId
    block_ids: tuple[int, ...]
    start: int
    end: int
    last: bool  # the prompt is complete after this chunk
    prompt_hash: str = ""  # which prompt this KV belongs to: a registration for another prompt is refused


@dataclass(frozen=True, slots=True)
class PushEnded:
    """P: a push request finished: `handed_off` if its KV is complete and should reach D."""

    request_id: ReqId
    transfer_id: TransferId
    block_ids: tuple[int, ...]
    num_tokens: int
    handed_off: bool
    prompt_hash: str = ""


@dataclass(frozen=True, slots=True)
class PushRegistration:
    """D: register these blocks with P for this transfer."""

    request_id: ReqId
    transfer_id: TransferId
    host: str
    port: int
    engine_id: str
    first_block: int
    block_ids: tuple[int, ...]
    num_tokens: int
    token: str
    prompt_hash: str = ""  # D's prompt: P refuses to write KV computed for another one
