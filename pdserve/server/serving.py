"""The OpenAI completions and chat endpoints on top of the async engine.

A request fans out to one engine request per (prompt, sample); their outputs are merged back into one
response, or one SSE stream, in vLLM's shapes (including top-level ``kv_transfer_params`` on non-streaming
responses).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdserve.ec_transfer.params import parse_ec_params
from pdserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestTimeoutError
from pdserve.engine.llm_engine import PromptError
from pdserve.engine.output_processor import RequestOutput
from pdserve.engine.request import MultiModalItem, TokenLogprobs
from pdserve.ids import ReqId, make_internal_request_id
from pdserve.kv_transfer.params import RemoteDecode, RemotePrefill
from pdserve.net.headers import bounded_list
from pdserve.multimodal.prompt import IMAGE_PART_TYPES, MultimodalInputError, MultimodalPrompter
from pdserve.sampling_params import SamplingParams, SamplingParamsError
from pdserve.server.errors import OpenAIError, bad_request, error_body
from pdserve.server.kv_admission import KVAdmission, KVRequestParams, ParsedKV
from pdserve.server.logprobs import LogprobsFormatter
from pdserve.server.prompt_limits import PromptLimits, message_chars
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedFieldError
from pdserve.server.workers import WorkerPool
from pdserve.telemetry.timeline import Origin, Timeline, TimelineStore
from pdserve.tokenizer import Tokenizer, TokenizerError

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()


@dataclass(slots=True)
class _Prompt:
    token_ids: list[int]
    text: str | None
    mm_items: list[MultiModalItem] = field(default_factory=list)


@dataclass(slots=True)
class _Sequence:
    """Accumulated state of one (prompt, sample) engine request."""

    prompt_index: int
    sample_index: int
    choice_index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text_offset: int = 0  # where the next streamed logprobs chunk starts, in characters of token strings
    final: RequestOutput | None = None


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, tokenizer: Tokenizer, max_model_len: int,
                 kv_params: KVRequestParams | None = None, prompter: MultimodalPrompter | None = None,
                 role: str = "both", timelines: TimelineStore | None = None,
                 workers: WorkerPool | None = None) -> None:
        self.engine = engine
        self.workers = workers or WorkerPool()
        self.role = role
        self.timelines = timelines or TimelineStore()
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.logprobs = LogprobsFormatter(tokenizer)
        self.max_model_len = max_model_len
        self.limits = PromptLimits(max_model_len, tokenizer.max_token_chars)
        self.kv = KVAdmission(kv_params)
        self.prompter = prompter  # set for multimodal models

    # -- entry points -----------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, origin: Origin,
                          headers: dict[str, str] | None = None) -> dict | AsyncIterator[bytes]:
        kv = self.kv.parse(body.kv_transfer_params)
        return await self._refusing_tells_producer(kv, self._completions(body, kv, origin, headers))

    async def chat(self, body: ChatCompletionRequest, origin: Origin,
                   headers: dict[str, str] | None = None) -> dict | AsyncIterator[bytes]:
        kv = self.kv.parse(body.kv_transfer_params)
        return await self._refusing_tells_producer(kv, self._chat(body, kv, origin, headers))

    async def _refusing_tells_producer(self, kv: ParsedKV, work: Any) -> dict | AsyncIterator[bytes]:
        """A request that holds KV on a prefill instance and is refused here must free it there, at once."""
        try:
            return await work
        except OpenAIError as exc:
            self.kv.refused(kv, exc.message)
            raise

    async def _completions(self, body: CompletionRequest, kv: ParsedKV, origin: Origin,
                           headers: dict[str, str] | None) -> dict | AsyncIterator[bytes]:
        self._check_common(body)
        prompts = [self._truncated(body, await self._completion_prompt(p, body.truncate_prompt_tokens is None))
                   for p in body.prompts()]
        params = [self._params(body, body.max_tokens, len(p.token_ids)) for p in prompts]
        return await self._run("completion", body, kv, origin, prompts, params, headers)

    async def _chat(self, body: ChatCompletionRequest, kv: ParsedKV, origin: Origin,
                    headers: dict[str, str] | None) -> dict | AsyncIterator[bytes]:
        self._check_common(body)
        if body.echo:
            raise OpenAIError(400, "'echo' is not supported by pdserve for chat completions", "echo")
        prompt = self._truncated(body, await self._chat_prompt(body))
        token_ids = prompt.token_ids
        params = [self._params(body, body.requested_max_tokens(), len(token_ids))]
        return await self._run("chat", body, kv, origin, [prompt], params, headers)

    async def _chat_prompt(self, body: ChatCompletionRequest) -> _Prompt:
        messages = body.message_dicts()
        self.limits.check_chars(message_chars(messages), "messages")
        template = {"add_generation_prompt": body.add_generation_prompt,
                    "continue_final_message": body.continue_final_message, "tools": body.tools,
                    "chat_template_kwargs": body.chat_template_kwargs}
        try:
            if self.prompter is not None and has_media(messages):
                # Decoding and preprocessing images is real work: keep it off the event loop.
                sources = parse_ec_params(body.ec_transfer_params)  # the one place they are read
                token_ids, items = await self.workers.run(self.prompter.build, messages, sources, **template)
                return _Prompt(token_ids, None, items)
            flat = flatten_messages(messages)
            return _Prompt(await self.workers.run(self.tokenizer.encode_chat, flat, **template), None)
        except (TokenizerError, MultimodalInputError) as exc:
            raise bad_request(str(exc), "messages") from exc

    # -- validation -------------------------------------------------------------------------------------
    def _check_common(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.model is not None and body.model != self.model_name:
            raise OpenAIError(404, f"The model `{body.model}` does not exist.", "model", "NotFoundError")
        try:
            body.check_supported()
        except UnsupportedFieldError as exc:
            raise bad_request(str(exc), exc.field_name) from exc
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
        ignored = body.unknown_fields()
        if ignored:
            log.debug("ignoring unknown request fields: %s", ignored)

    def _truncated(self, body: CompletionRequest | ChatCompletionRequest, prompt: _Prompt) -> _Prompt:
        """`truncate_prompt_tokens`: keep the prompt's last k tokens, as vLLM does (-1: max_model_len)."""
        k = body.truncate_prompt_tokens
        if k is None:
            return prompt
        if k > self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens ({k}) is greater than max_model_len ({self.max_model_len}); "
                              f"please select a smaller truncation size", "truncate_prompt_tokens")
        keep = self.max_model_len if k == -1 else k
        if len(prompt.token_ids) <= keep:
            return prompt
        if prompt.mm_items:
            raise bad_request("truncate_prompt_tokens cannot cut a prompt with images", "truncate_prompt_tokens")
        return _Prompt(prompt.token_ids[len(prompt.token_ids) - keep:], None)

    async def _completion_prompt(self, prompt: str | list[int], bounded: bool = True) -> _Prompt:
        if isinstance(prompt, str):
            if bounded:  # a prompt the client wants truncated may be long: it is cut after tokenizing
                self.limits.check_chars(len(prompt), "prompt")
            return _Prompt(await self.workers.run(self.tokenizer.encode, prompt), prompt)
        return _Prompt(list(prompt), None)

    def _params(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                prompt_len: int) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise self.limits.too_long(prompt_len)
        if max_tokens is not None and max_tokens > room:
            raise bad_request(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
                f"length is {self.max_model_len} tokens and your request has {prompt_len} input tokens "
                f"({max_tokens} > {self.max_model_len} - {prompt_len}).", "max_tokens")
        params = body.sampling_params(max_tokens if max_tokens is not None else room)
        try:
            params.validate(self.engine.engine.vocab_size)
        except SamplingParamsError as exc:
            raise bad_request(str(exc), exc.param) from exc
        return params

    # -- running ----------------------------------------------------------------------------------------
    async def _run(self, kind: str, body: Any, kv: ParsedKV, origin: Origin, prompts: list[_Prompt],
                   params: list[SamplingParams], headers: dict[str, str] | None) -> dict | AsyncIterator[bytes]:
        kv_params = await self.kv.admit(kv, len(prompts), params[0].n, prompts[0].token_ids)
        response_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{origin.request_id}"
        sequences: list[_Sequence] = []
        streams: list[AsyncIterator[RequestOutput]] = []
        internal_ids: list[str] = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            for j in range(p.n):
                base = f"{response_id}-{i}" if kind == "completion" else response_id
                external = base if p.n == 1 else f"{j}_{base}"
                rid = make_internal_request_id(external)
                internal_ids.append(rid)
                sequences.append(_Sequence(i, j, len(sequences)))
                items = [dataclasses.replace(m) for m in prompt.mm_items]  # each sample owns its items' flags
                timeline = self.timelines.start(origin.request_id, self.role, origin.arrival_ns,
                                                internal_request_id=rid, transfer_id=_transfer_id_of(kv_params),
                                                traceparent=origin.traceparent)
                streams.append(self._generate(external, rid, prompt.token_ids, p.for_child(j), kv_params, items,
                                              timeline))
        if origin.access is not None:
            origin.access.usage = lambda: _usage(prompts, sequences)
        if headers is not None:
            # The instance's own ids (external id + random suffix): useful in logs, never shared between P and D.
            # As many as fit a header; all of them are in the timeline.
            headers["X-Pdserve-Request-Ids"], omitted = bounded_list(internal_ids)
            if omitted:
                headers["X-Pdserve-Request-Ids-Omitted"] = str(omitted)
        created = int(time.time())
        if body.stream:
            return self._stream(kind, body, response_id, created, prompts, sequences, streams)
        await self._collect(sequences, streams)
        return self._response(kind, body, response_id, created, prompts, sequences)

    def _generate(self, external_id: str, request_id: ReqId, token_ids: list[int], params: SamplingParams,
                  kv_params: RemoteDecode | RemotePrefill | None, mm_items: list[MultiModalItem] | None = None,
                  timeline: Timeline | None = None) -> AsyncIterator[RequestOutput]:
        try:
            self.engine.check_prompt(token_ids)  # the sampling params were validated in `_params`
        except PromptError as exc:
            raise bad_request(str(exc)) from exc
        return self.engine.generate(external_id, token_ids, params, kv_transfer_params=kv_params,
                                    mm_items=mm_items or None, request_id=request_id, timeline=timeline)

    async def _collect(self, sequences: list[_Sequence], streams: list[AsyncIterator[RequestOutput]]) -> None:
        async for index, out in merge(streams):
            _absorb(sequences[index], out)
        for seq in sequences:
            _raise_if_failed(seq.final)

    def _response(self, kind: str, body: Any, response_id: str, created: int, prompts: list[_Prompt],
                  sequences: list[_Sequence]) -> dict:
        choices = []
        for seq in sequences:
            final = seq.final
            choice: dict[str, Any] = {"index": seq.choice_index, "finish_reason": final.finish_reason,
                                      "stop_reason": final.stop_reason}
            prompt = prompts[seq.prompt_index]
            if kind == "completion":
                text = seq.text
                if body.echo:
                    text = (prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)) + text
                choice["text"] = text
                choice["logprobs"] = (self.logprobs.completion(seq.logprobs, [])
                                      if body.logprobs is not None else None)
            else:
                choice["message"] = {"role": "assistant", "content": seq.text}
                choice["logprobs"] = self.logprobs.chat(seq.logprobs, [], body.top_logprobs or 0) if body.logprobs else None
            if body.return_token_ids:
                choice["token_ids"] = seq.token_ids
                if kind == "completion":
                    choice["prompt_token_ids"] = prompt.token_ids
            choices.append(choice)
        response = {
            "id": response_id, "object": "text_completion" if kind == "completion" else "chat.completion",
            "created": created, "model": self.model_name, "choices": choices,
            "usage": _usage(prompts, sequences),
            "kv_transfer_params": _kv_wire(sequences[0].final) if len(sequences) == 1 else None,
        }
        if kind == "chat" and body.return_token_ids:
            response["prompt_token_ids"] = prompts[0].token_ids
        return response

    async def _stream(self, kind: str, body: Any, response_id: str, created: int, prompts: list[_Prompt],
                      sequences: list[_Sequence], streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[bytes]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"

        def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
            payload: dict[str, Any] = {"id": response_id, "object": obj, "created": created,
                                       "model": self.model_name, "choices": choices}
            if include_usage:
                payload["usage"] = usage
            return b"data: " + _json.encode(payload) + b"\n\n"

        try:
            if kind == "chat":
                yield chunk([{"index": s.choice_index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None} for s in sequences])
            async for index, out in merge(streams):
                seq = sequences[index]
                _absorb(seq, out)
                if out.finished and out.finish_reason in ("error", "abort"):
                    yield b"data: " + _json.encode(_failure_body(out)) + b"\n\n"
                    break
                # A token whose text is held back (half a UTF-8 character, a possible stop string) sends no chunk,
                # unless the client asked for token ids: those must all arrive.
                if not (out.new_text or out.finished or out.new_logprobs
                        or (body.return_token_ids and out.new_token_ids)):
                    continue
                usage = _usage(prompts, sequences) if continuous else None
                yield chunk([self._stream_choice(kind, body, seq, out)], usage)
            else:
                if include_usage:
                    yield chunk([], _usage(prompts, sequences))
        except (EngineDeadError, RequestTimeoutError) as exc:
            yield b"data: " + _json.encode(error_body(503 if isinstance(exc, EngineDeadError) else 504, str(exc))) + b"\n\n"
        yield b"data: [DONE]\n\n"

    def _stream_choice(self, kind: str, body: Any, seq: _Sequence, out: RequestOutput) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": seq.choice_index}
        # The tokens sampled before this chunk's (already absorbed into `seq`) decide how a split character reads.
        context = [lp.token_id for lp in seq.logprobs[:len(seq.logprobs) - len(out.new_logprobs)]]
        if kind == "completion":
            choice["text"] = out.new_text
            choice["logprobs"] = None
            if body.logprobs is not None:
                choice["logprobs"] = self.logprobs.completion(out.new_logprobs, context, seq.text_offset)
                seq.text_offset += sum(len(token) for token in choice["logprobs"]["tokens"])
        else:
            choice["delta"] = {"content": out.new_text} if out.new_text or not out.finished else {}
            choice["logprobs"] = (self.logprobs.chat(out.new_logprobs, context, body.top_logprobs or 0)
                                  if body.logprobs else None)
        if body.return_token_ids:
            choice["token_ids"] = out.new_token_ids
        choice["finish_reason"] = out.finish_reason if out.finished else None
        choice["stop_reason"] = out.stop_reason if out.finished else None
        return choice

# -- helpers ----------------------------------------------------------------------------------------------
def _transfer_id_of(kv_params: RemoteDecode | RemotePrefill | None) -> str | None:
    return getattr(kv_params, "transfer_id", None)


def has_media(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") in IMAGE_PART_TYPES for p in m["content"])
               for m in messages)


def flatten_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Text-only content parts become one string, which every chat template understands."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type")
                if kind == "text":
                    parts.append(part.get("text", ""))
                else:
                    raise bad_request(f"content parts of type {kind!r} are not supported by this model", "messages")
            message = {**message, "content": "\n".join(parts)}
        out.append(message)
    return out


def _absorb(seq: _Sequence, out: RequestOutput) -> None:
    seq.token_ids.extend(out.new_token_ids)
    seq.text += out.new_text
    seq.logprobs.extend(out.new_logprobs)
    if out.finished:
        seq.final = out


def _kv_wire(final: RequestOutput) -> dict[str, Any] | None:
    return None if final.kv_transfer_params is None else final.kv_transfer_params.to_wire()


def _raise_if_failed(final: RequestOutput | None) -> None:
    if final is None:
        raise OpenAIError(500, "the request ended without a result")
    if final.finish_reason == "error":
        raise OpenAIError(final.error_status, final.error or "the request failed in the engine")
    if final.finish_reason == "abort":
        raise OpenAIError(503, final.error or "the request was aborted")


def _failure_body(out: RequestOutput) -> dict[str, Any]:
    status = out.error_status if out.finish_reason == "error" else 503
    return error_body(status, out.error or f"the request ended with finish_reason={out.finish_reason}")


def _usage(prompts: list[_Prompt], sequences: list[_Sequence]) -> dict[str, Any]:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion = sum(len(s.token_ids) for s in sequences)
    cached = 0
    for seq in sequences:
        if seq.sample_index == 0 and seq.final is not None:
            cached += seq.final.num_cached_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as items arrive; closing the merge closes every stream (aborting)."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
