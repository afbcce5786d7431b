"""A request as the scheduler sees it: token ids, progress counters and status. No tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.ec_transfer.params import ECSource
from pdserve.ids import ReqId
from pdserve.kv_transfer.params import KVHandOff, RemoteDecode, RemotePrefill
from pdserve.sampling_params import SamplingParams
from pdserve.telemetry.timeline import Timeline


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything from here on is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()
    # Moved to another instance mid-generation (pdserve.migration): it goes on there, not here.
    FINISHED_MIGRATED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_MIGRATED: "migrated",
}


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of one sampled token and its top alternatives (ids and logprobs, best first)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class MultiModalItem:
    """One media item of a prompt: its placeholder range and identity (filled in by the multimodal issue)."""

    mm_hash: str
    offset: int
    length: int
    data: Any = None  # preprocessed input (e.g. pixel values); lives with the model runner, never inspected here
    remote: bool = False  # ec_transfer_params said an encode instance holds its output
    source: ECSource | None = None  # its ec_transfer_params entry: where the output is and how to fetch it


@dataclass(eq=False, slots=True)
class Request:
    request_id: ReqId
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    external_id: str = ""
    kv_transfer_params: RemoteDecode | RemotePrefill | None = None  # parsed where the server read the request
    returned_kv_transfer_params: KVHandOff | None = None  # what the connector hands back at finish
    mm_items: list[MultiModalItem] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until scheduled
    num_external_tokens: int = 0  # tokens a connector loaded from another instance
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    error_status: int = 500  # the HTTP status an error maps to (400 when the request itself was at fault)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    timeline: Timeline | None = None  # what happened when, for /v1/timeline and traces (servers only)

    def mark(self, event: str, **attrs: Any) -> None:
        """Record an event on the request's timeline, if it has one (offline `LLM` requests have none)."""
        if self.timeline is not None:
            self.timeline.add(event, **attrs)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_range(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens or 1 << 30
