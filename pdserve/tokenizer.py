"""Tokenizer, chat template and incremental detokenization, on top of Hugging Face's tokenizers.

Chat templates render through transformers' ``apply_chat_template`` so that prompts tokenize exactly as the
model's authors intended; detokenization streams through ``tokenizers.decoders.DecodeStream``, primed with the
tail of the prompt so SentencePiece-style leading spaces come out right.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

# How many prompt tokens prime a detokenizer (enough for any merge or leading-space context).
_PRIMING_TOKENS = 6


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, path: Path | str) -> None:
        from transformers import AutoTokenizer  # heavy import, kept off module import time

        try:
            self.hf = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:  # noqa: BLE001 - transformers raises many types here
            raise TokenizerError(f"cannot load a tokenizer from {path}: {exc}") from exc
        self.backend = getattr(self.hf, "backend_tokenizer", None)
        self.eos_token_ids = self._eos_ids(Path(path))
        self.vocab_size = len(self.hf)
        # The longest vocabulary entry: no token stands for more characters of text than this (byte-level entries
        # spell one character per byte, and a character is at least one byte), which bounds a prompt's length in
        # tokens from below without tokenizing it.
        self.max_token_chars = max((len(t) for t in self.hf.get_vocab()), default=1)

    def _eos_ids(self, path: Path) -> tuple[int, ...]:
        ids = [] if self.hf.eos_token_id is None else [self.hf.eos_token_id]
        gen = path / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            for token_id in eos if isinstance(eos, list) else [eos]:
                if token_id is not None and token_id not in ids:
                    ids.append(token_id)
        return tuple(ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict] | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> str:
        if not self.has_chat_template:
            raise TokenizerError("this model's tokenizer has no chat template; use /v1/completions")
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools, **(chat_template_kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - template errors are user errors
            raise TokenizerError(f"the chat template could not render these messages: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        # The rendered template already carries any BOS it wants; adding special tokens again would double it.
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)

    def detokenizer(self, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        if self.backend is not None:
            return StreamDetokenizer(self.backend, prompt_token_ids[-_PRIMING_TOKENS:], skip_special_tokens)
        return FullDecodeDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    def step(self, token_id: int) -> str:
        raise NotImplementedError


class StreamDetokenizer(IncrementalDetokenizer):
    def __init__(self, backend: Any, priming_ids: list[int], skip_special_tokens: bool) -> None:
        self.backend = backend
        self.stream = DecodeStream(ids=priming_ids, skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self.stream.step(self.backend, token_id) or ""


class FullDecodeDetokenizer(IncrementalDetokenizer):
    """For tokenizers without a Rust backend: decode everything and emit the new suffix (quadratic, rare)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, self.skip)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        new, self.text = text[len(self.text):], text
        return new
