"""Request bodies of vLLM's OpenAI dialect, and their translation into SamplingParams.

Unknown fields are accepted and ignored (as vLLM does; routers add their own defaults), but fields that name a
feature pdserve does not implement are refused with a 400 rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from pdserve.sampling_params import SamplingParams


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
    seed: int | None = None
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

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())

    def _common_checks(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFieldError("best_of", "only best_of == n is supported")
        if self.logit_bias:
            raise UnsupportedFieldError("logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        extra = self.model_extra or {}
        for name in ("prompt_logprobs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs", "return_hidden_states", "allowed_token_ids", "bad_words"):
            if extra.get(name) not in (None, False, [], {}):
                raise UnsupportedFieldError(name)

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

    def check_supported(self) -> None:
        self._common_checks()
        if self.suffix:
            raise UnsupportedFieldError("suffix")
        if self.echo and self.logprobs is not None:
            raise UnsupportedFieldError("echo with logprobs", "prompt logprobs are not computed")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string, token ids, or a batch of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            return list(p)
        raise ValueError("prompt must be a string, a list of strings, a list of token ids, or a list of those")

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
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    echo: bool = False

    def check_supported(self) -> None:
        self._common_checks()
        if self.tool_choice not in (None, "none", "auto"):
            raise UnsupportedFieldError("tool_choice", "only 'none' and 'auto' (no tool parsing) are supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise UnsupportedFieldError("response_format", "structured output is not implemented")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs)

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

