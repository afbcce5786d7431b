"""Typed per-step messages between the scheduler and the model runner (the only thing they share)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import MultiModalItem, TokenLogprobs
from pdserve.ids import ReqId
from pdserve.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    request_id: ReqId
    token_ids: list[int]  # the tokens to compute this step
    start_position: int  # num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table
    sample: bool  # this chunk reaches the end of the known tokens, so a token is sampled
    sampling_params: SamplingParams
    prompt_token_ids: list[int]  # read by penalties; never copied
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()
    # Media items whose embeddings this chunk needs; the runner encodes or loads them.
    mm_items: list[MultiModalItem] = field(default_factory=list)
    mm_to_produce: set[str] = field(default_factory=set)  # of those, the ones not in the encoder cache yet

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.start_position > 0


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_req_ids: set[ReqId] = field(default_factory=set)  # runner drops their per-request state
    kv_connector_metadata: object | None = None
    free_mm_hashes: list[str] = field(default_factory=list)  # encoder outputs the runner may drop

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """How one request's KV load went, as the connector saw it (for the request's timeline)."""

    started_at: float  # time.monotonic() when the load (or push registration) began
    seconds: float
    nbytes: int
    data_plane: str
    ok: bool


@dataclass(slots=True)
class KVConnectorOutput:
    finished_sending: set[ReqId] = field(default_factory=set)
    finished_recving: set[ReqId] = field(default_factory=set)
    failed_recving: set[ReqId] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    refused_recving: dict[ReqId, str] = field(default_factory=dict)
    transfers: dict[ReqId, TransferRecord] = field(default_factory=dict)


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[ReqId, int] = field(default_factory=dict)
    logprobs: dict[ReqId, TokenLogprobs] = field(default_factory=dict)
    connector: KVConnectorOutput = field(default_factory=KVConnectorOutput)
    invalid_mm_hashes: dict[str, str] = field(default_factory=dict)  # encoder outputs that failed to load: why
    # The model step raised: none of these requests advanced, and each ends with `error` (the engine serves on).
    failed_req_ids: set[ReqId] = field(default_factory=set)
    error: str = ""
