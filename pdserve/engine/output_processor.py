"""From engine requests to client-facing deltas: detokenization, stop strings, finish reasons."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import Request, RequestStatus, TokenLogprobs
from pdserve.ids import ReqId
from pdserve.kv_transfer.params import KVHandOff
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one sequence."""

    request_id: ReqId
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    kv_transfer_params: KVHandOff | None = None  # the server writes its wire form into the response
    error: str | None = None
    error_status: int = 500
    arrival_time: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class _TextState:
    detokenizer: IncrementalDetokenizer
    stop: list[str]
    include_stop: bool
    hold_back: int  # characters kept back while streaming, since they may start a stop string
    text: str = ""
    emitted_chars: int = 0
    emitted_tokens: int = 0
    checked_chars: int = 0  # text already searched for stop strings (or held back from it by min_tokens)
    stop_hit: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[ReqId, _TextState | None] = {}

    def add_request(self, request: Request, detokenize: bool = True) -> None:
        if not detokenize or self.tokenizer is None:
            self.states[request.request_id] = None
            return
        self.states[request.request_id] = _text_state(self.tokenizer, request.prompt_token_ids,
                                                      request.sampling_params)

    def restore(self, request: Request, detokenize: bool = True) -> None:
        """A request arriving with outputs its client was already sent elsewhere: the text state they leave,
        with all of it emitted except what the stop strings hold back (it is sent from here)."""
        self.add_request(request, detokenize)
        state = self.states[request.request_id]
        if state is None:
            return
        state.text = "".join(state.detokenizer.step(token_id) for token_id in request.output_token_ids)
        state.checked_chars = len(state.text)
        state.emitted_chars = max(len(state.text) - state.hold_back, 0)
        state.emitted_tokens = request.num_output_tokens

    def process(self, requests: list[Request]) -> tuple[list[RequestOutput], list[ReqId]]:
        """Returns the outputs, and the requests a stop string just ended (the caller finishes them)."""
        outputs, stopped = [], []
        for request in requests:
            rid = request.request_id
            if rid not in self.states:
                continue
            state = self.states[rid]
            new_ids = request.output_token_ids[state.emitted_tokens:] if state else []
            if state is not None and self._advance_text(state, request, new_ids):
                stopped.append(rid)
            outputs.append(self._make_output(request, state, new_ids, stop_hit=rid in stopped))
        return outputs, stopped

    def _advance_text(self, state: _TextState, request: Request, new_ids: list[int]) -> bool:
        """Feed new tokens; True when a stop string ended the sequence (text is then cut)."""
        # A sequence just capped by max_tokens may still end in a stop string, which then wins (as in vLLM);
        # an EOS / stop token id that ended a sequence is not searched, nor is an aborted or failed sequence.
        searchable = not request.is_finished or request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        first_index = request.num_output_tokens - len(new_ids)
        # The EOS or stop token id that ended a sequence is not part of its text (vLLM drops it too).
        drop_last = _ended_by_stop_token(request) and not state.include_stop
        for i, token_id in enumerate(new_ids):
            piece = state.detokenizer.step(token_id)
            if drop_last and i == len(new_ids) - 1:
                continue
            state.text += piece
            # min_tokens holds back stop strings too, not just EOS and stop token ids (vLLM PR 22014).
            if first_index + i + 1 <= request.sampling_params.min_tokens:
                state.checked_chars = len(state.text)
            elif searchable and state.stop and self._cut_at_stop(state):
                return True
        return False

    def _cut_at_stop(self, state: _TextState) -> bool:
        """Cut at the earliest stop string that ends in text not searched before."""
        best: tuple[int, str] | None = None
        for stop in state.stop:
            at = state.text.find(stop, max(state.checked_chars - len(stop) + 1, 0))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        state.checked_chars = len(state.text)
        if best is None:
            return False
        at, stop = best
        state.text = state.text[:at + len(stop)] if state.include_stop else state.text[:at]
        state.stop_hit = stop
        return True

    def _make_output(self, request: Request, state: _TextState | None, new_ids: list[int],
                     stop_hit: bool) -> RequestOutput:
        finished = request.is_finished or stop_hit
        new_text = ""
        if state is not None:
            # A request that moved on to another instance keeps back what it held: that instance sends it.
            flush = finished and request.status != RequestStatus.FINISHED_MIGRATED
            visible = len(state.text) if flush else max(len(state.text) - state.hold_back, state.emitted_chars)
            new_text = state.text[state.emitted_chars:visible]
            state.emitted_chars = visible
            state.emitted_tokens = request.num_output_tokens
        first = request.num_output_tokens - len(new_ids)
        out = RequestOutput(
            request_id=request.request_id,
            new_token_ids=list(new_ids),
            new_text=new_text,
            new_logprobs=request.output_logprobs[first:] if request.output_logprobs else [],
            finished=finished,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_output_tokens=request.num_output_tokens,
            arrival_time=request.arrival_time,
        )
        if finished:
            out.finish_reason = "stop" if stop_hit else request.status.finish_reason
            out.stop_reason = state.stop_hit if stop_hit and state is not None else request.stop_reason
            out.kv_transfer_params = request.returned_kv_transfer_params
            out.error = request.error
            out.error_status = request.error_status
            out.metrics = _request_metrics(request)
            self.states.pop(request.request_id, None)
        return out

    def drop(self, request_id: ReqId) -> None:
        self.states.pop(request_id, None)


def _text_state(tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> _TextState:
    hold = 0 if params.include_stop_str_in_output else max(params.max_stop_string_length - 1, 0)
    return _TextState(detokenizer=tokenizer.detokenizer(prompt_token_ids, params.skip_special_tokens),
                      stop=params.stop, include_stop=params.include_stop_str_in_output, hold_back=hold)


def sent_text(tokenizer: Tokenizer, prompt_token_ids: list[int], output_token_ids: list[int],
              params: SamplingParams) -> str:
    """The text a client of a running request has been sent once these outputs were produced: all of their text
    but what a stop string may yet need (held back until it cannot)."""
    state = _text_state(tokenizer, prompt_token_ids, params)
    text = "".join(state.detokenizer.step(token_id) for token_id in output_token_ids)
    return text[:max(len(text) - state.hold_back, 0)]


def _ended_by_stop_token(request: Request) -> bool:
    if request.status != RequestStatus.FINISHED_STOPPED or not request.output_token_ids:
        return False
    return isinstance(request.stop_reason, int) or request.output_token_ids[-1] in request.eos_token_ids


def _request_metrics(request: Request) -> dict[str, float]:
    m = {"arrival": request.arrival_time}
    if request.first_scheduled_time is not None:
        m["first_scheduled"] = request.first_scheduled_time
    if request.first_token_time is not None:
        m["first_token"] = request.first_token_time
    if request.last_token_time is not None:
        m["last_token"] = request.last_token_time
    return m

