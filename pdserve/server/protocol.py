"""Request bodies of vLLM's OpenAI dialect, and their translation into SamplingParams.

Unknown fields are accepted and ignored (as vLLM does; routers add their own defaults), but fields of vLLM's
dialect that name a feature pdserve does not implement are refused with a 400 naming the field rather than
silently ignored. Every number is range-checked here or in SamplingParams.validate, before anything reaches the
engine: a value the engine cannot take must be the client's 400, never the engine's failure.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.sampling_params import MAX_LOGPROBS, SamplingParams

# torch generators take 64-bit seeds; vLLM bounds `seed` the same way.
Seed = Annotated[int, Field(ge=-(2 ** 63), le=2 ** 63 - 1)]

# vLLM fields pdserve does not implement, with the values that mean "not used" (those are accepted).
_REFUSED_UNLESS: dict[str, tuple[Any, ...]] = {
    "prompt_logprobs": (None,), "prompt_embeds": (None,), "allowed_token_ids": (None,), "bad_words": (None, []),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,), "structured_outputs": (None,),
    "logits_processors": (None,), "vllm_xargs": (None,), "return_hidden_states": (None, False),
    "use_beam_search": (None, False), "priority": (None, 0), "cache_salt": (None,),
    "return_tokens_as_token_ids": (None, False), "functions": (None,), "function_call": (None,),
    "chat_template": (None,), "documents": (None,),
}
_WHY = {
    "cache_salt": "prefix-cache isolation is not implemented",
    "priority": "requests are scheduled first come, first served",
    "functions": "function calling is not implemented",
    "function_call": "function calling is not implemented",
    "chat_template": "only the model's own chat template is used",
}


class UnsupportedFieldError(ValueError):
    def __init__(self, field_name: str, detail: str = "") -> None:
        super().__init__(f"'{field_name}' is not supported by pdserve{': ' + detail if detail else ''}")
        self.field_name = field_name


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: Seed | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Becomes the X-Request-Id response header: only what a header value can carry (visible ASCII).
    request_id: str | None = Field(default=None, pattern=r"^[\x21-\x7e]+$", max_length=256)
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None  # -1: keep the last max_model_len - 1
    response_format: dict[str, Any] | None = None
    add_special_tokens: bool | None = None

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())

    def _common_checks(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFieldError("best_of", "only best_of == n is supported")
        if self.logit_bias:
            raise UnsupportedFieldError("logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise UnsupportedFieldError("response_format", "structured output is not implemented")
        extra = self.model_extra or {}
        for name, unused in _REFUSED_UNLESS.items():
            value = extra.get(name)
            if not any(value is u or (type(value) is type(u) and value == u) for u in unused):
                raise UnsupportedFieldError(name, _WHY.get(name, ""))

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


_NonEmpty = Field(min_length=1)


class CompletionRequest(_SamplingFields):
    prompt: (str | Annotated[list[str], _NonEmpty] | Annotated[list[int], _NonEmpty]
             | Annotated[list[list[int]], _NonEmpty])
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, p: str | list[str] | list[int] | list[list[int]]
                          ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(p, list) and not p:
            raise ValueError("prompt must not be an empty list")
        return p

    def check_supported(self) -> None:
        self._common_checks()
        if self.suffix:
            raise UnsupportedFieldError("suffix")
        if self.echo and self.logprobs is not None:
            raise UnsupportedFieldError("echo with logprobs", "prompt logprobs are not computed")
        if self.add_special_tokens is False:
            raise UnsupportedFieldError("add_special_tokens", "completion prompts always get them")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string, token ids, or a batch of either (never empty: see the validator)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        return self._sampling(max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    echo: bool = False

    def check_supported(self) -> None:
        self._common_checks()
        if self.tools and self.tool_choice != "none":
            # vLLM too refuses tools unless a tool-call parser is configured; pdserve has none. With
            # tool_choice "none" the tools are only rendered into the prompt by the chat template.
            raise UnsupportedFieldError("tools", "tool calls are not parsed; send tool_choice 'none' to only "
                                                 "render the tools into the prompt")
        if self.tool_choice not in (None, "none"):
            raise UnsupportedFieldError("tool_choice", "only 'none' is supported (tool calls are not parsed)")
        if self.add_special_tokens:
            raise UnsupportedFieldError("add_special_tokens", "the chat template decides the special tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs)

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

