"""Prompts too long for the context window, refused as early and as cheaply as their form allows.

Token ids are counted before the body is validated (validating costs about a microsecond per id, on the event
loop); text is measured in characters before it is tokenized; what passes both is checked exactly, in tokens, after
tokenizing. Every refusal is vLLM's "maximum context length" 400.
"""

from __future__ import annotations

from typing import Any

from pdserve.server.errors import OpenAIError, bad_request

# Unicode normalizers (NFC, NFKC) may fold up to three characters into one before tokenizing: text is refused
# unread only when even that could not bring it within the context window.
NORMALIZATION_SLACK = 4


class PromptLimits:
    def __init__(self, max_model_len: int, max_token_chars: int) -> None:
        self.max_model_len = max_model_len
        # No token stands for more characters than the longest vocabulary entry spells.
        self.max_chars = max_model_len * max_token_chars * NORMALIZATION_SLACK

    def too_long(self, prompt_tokens: int, param: str = "messages") -> OpenAIError:
        return bad_request(
            f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages.", param)

    def check_unvalidated(self, data: dict[str, Any]) -> None:
        """A completion body as decoded, before validation: token-id prompts by their length alone."""
        prompt = data.get("prompt")
        if not isinstance(prompt, list) or not prompt or data.get("kv_transfer_params"):
            return  # a refused request whose KV a prefill instance holds must tell it: the full path does
        if data.get("truncate_prompt_tokens") is not None:
            return  # the client asked for the prompt to be cut to fit: validation and truncation decide
        for ids in prompt if isinstance(prompt[0], list) else [prompt]:
            if isinstance(ids, list) and ids and isinstance(ids[0], int) and len(ids) > self.max_model_len:
                raise self.too_long(len(ids), "prompt")

    def check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{chars} characters of input, more than {self.max_model_len} tokens can hold. Please reduce the "
                f"length of the input messages.", param)


def message_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of text in chat messages: string contents and text parts."""
    contents = [m.get("content") for m in messages]
    return sum(len(c) if isinstance(c, str) else sum(len(p["text"]) for p in c if isinstance(p.get("text"), str))
               for c in contents if isinstance(c, (str, list)))
