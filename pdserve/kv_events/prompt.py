"""A request's prompt as token ids, at the gateway: what the prefix index is keyed by.

The instances publish token ids, so the gateway must see the prompt as they will: token-id prompts as sent; text
prompts encoded with the model's own tokenizer.json (Hugging Face `tokenizers`, special tokens added as the
instances add them to completions); chat messages rendered through the model's chat template first (as
transformers renders it: chat_template.py), then encoded without adding special tokens (the template places them).
A request the gateway cannot render (images, an unknown template feature) has no token ids and is routed by load
alone. Keys per block size are computed on first use and kept with the prompt, so every pick of one request hashes
it once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from pdserve.kv_events import index_queries
from pdserve.kv_events.chat_template import ChatTemplate
from pdserve.kv_events.fast_bpe import fast_encoder
from pdserve.kv_events.index import ROOT_KEY, KeysOf
from pdserve.kv_events.lazy_ids import LazyIds
from pdserve.kv_events.pieces import SAMPLES, PieceEncoder

_MAX_TOKEN_ID = 2**31 - 1


class RoutedPrompt:
    """A prompt's token ids and their block keys, known at once (`tokens`) or encoded as far as asked (`lazy`)."""

    __slots__ = ("_tokens", "_lazy", "cached", "_keys", "_keys_of")

    def __init__(self, tokens: list[int] | None, lazy: LazyIds | None = None,
                 keys_of: KeysOf = index_queries.content_keys) -> None:
        """`keys_of`: how its blocks are keyed (the index's: in C where the index's core is)."""
        self._tokens = tokens
        self._lazy = lazy
        self._keys_of = keys_of
        self.cached: dict[str, float] = {}  # prompt tokens the instances picked for it held when picked
        self._keys: dict[int, list[int]] = {}  # per block size, the keys of its first blocks computed so far

    @property
    def routable(self) -> bool:
        """Whether its token ids can be known here (without encoding any)."""
        return self._tokens is not None or self._lazy is not None

    @property
    def exact(self) -> bool:
        """Whether all its ids are known (no encoding is left to do)."""
        return self._lazy is None or self._lazy.complete

    @property
    def tokens(self) -> list[int] | None:
        """All its ids (encoding whatever was left)."""
        if self._lazy is not None:
            self._tokens = self._lazy.finish() or None
            self._lazy = None
        return self._tokens

    @property
    def num_tokens(self) -> int:
        """Its length: exact where every id is known, else estimated from those encoded (a load figure only)."""
        if self._lazy is not None:
            return self._lazy.estimate()
        return len(self._tokens) if self._tokens is not None else 0

    def keys(self, block_size: int) -> list[int]:
        """Content keys of the prompt's whole blocks; the last token is never a hit (an engine computes it)."""
        return self._keyed(block_size, self.tokens)

    def head_keys(self, block_size: int, count: int) -> list[int]:
        """Keys of at least the first `count` blocks where it has them (fewer: it has no more), encoding only as
        far as they need; more where the ids already encoded key more."""
        keys = self._keys.get(block_size)
        if keys is not None and len(keys) >= count:
            return keys
        if self._lazy is None:
            return self._keyed(block_size, self._tokens)
        self._lazy.ensure(count * block_size + 1)  # the blocks, and the token after them (never a hit)
        return self._keyed(block_size, self._lazy.ids)

    def _keyed(self, block_size: int, tokens: list[int] | None) -> list[int]:
        """The keys of every whole block of `tokens` (the ids known so far) before its last token, computed once:
        each call keys only the blocks new since the last."""
        if tokens is None or block_size < 1:
            return []
        keys = self._keys.setdefault(block_size, [])
        count, first = (len(tokens) - 1) // block_size, len(keys)
        if first < count:
            keys += self._keys_of(tokens, first * block_size, block_size, count - first,
                                  keys[-1] if keys else ROOT_KEY)
        return keys


class PromptTokenizer:
    def __init__(self, path: str | Path, keys_of: KeysOf = index_queries.content_keys, minijinja: bool = True) -> None:
        """`path`: the model's (or tokenizer's) folder, as the instances were started with, or a tokenizer.json.
        `keys_of`: how its prompts' blocks are keyed (the index's). `minijinja`: render the chat template with it
        where it renders as jinja2 (False: jinja2 only).

        From a folder the tokenizer is taken as transformers builds it (which may replace tokenizer.json's
        pre-tokenizer and normalizer by the model family's own), in a child process so that this one never imports
        transformers or torch; a bare tokenizer.json is used as written.
        """
        from tokenizers import Tokenizer

        self.keys_of = keys_of
        path = Path(path)
        if path.is_dir():
            exported = _export(path)
            self.tokenizer = Tokenizer.from_str(exported["tokenizer"])
            template, self.special = exported["chat_template"], exported["special"]
        else:
            self.tokenizer = Tokenizer.from_file(str(path))
            template, self.special = None, {}
        self.template = ChatTemplate(template, minijinja) if isinstance(template, str) else None
        self.fast = fast_encoder(self.tokenizer)  # tiktoken, where it encodes as the tokenizer does
        self.pieces = PieceEncoder(self.tokenizer, ordinary=self.fast)
        self.framing = _framing(self.tokenizer, self.pieces) if self.pieces.lazy_ok else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def prompt(self, body: dict[str, Any]) -> RoutedPrompt:
        """The body's prompt as token ids (None when they cannot be known here); a chat prompt's, and a text
        prompt's, encoded lazily where the tokenizer allows it (lazy_ids.py)."""
        try:
            prompt = body.get("prompt")
            if "messages" in body and prompt is None and self.pieces.lazy_ok:
                text = self.render_chat(body)
                return RoutedPrompt(None, self.pieces.lazy(text) if text else None, self.keys_of)
            if isinstance(prompt, str) and prompt and self.framing is not None:
                return RoutedPrompt(None, self.pieces.lazy(prompt, *self.framing), self.keys_of)
            tokens = self._tokens(body)
        except Exception:  # noqa: BLE001 - a template error is the instance's to report; routing goes on
            return RoutedPrompt(None)
        return RoutedPrompt(tokens or None, keys_of=self.keys_of)

    def _tokens(self, body: dict[str, Any]) -> list[int] | None:
        prompt = body.get("prompt")
        if "messages" in body and prompt is None:
            text = self.render_chat(body)
            return None if text is None else self.pieces.encode(text)
        if isinstance(prompt, str):
            return self.encode(prompt)
        return token_ids(prompt)

    def render_chat(self, body: dict[str, Any]) -> str | None:
        """The chat prompt as the template renders it; with no template (a bare tokenizer.json), the messages'
        contents joined, which counts a prompt's length closely but names no instance's blocks."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        flat = []
        for message in messages:
            if not isinstance(message, dict):
                return None
            content = message.get("content")
            if isinstance(content, list):
                if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                    return None  # media: its placeholder tokens do not say which image
                message = {**message, "content": "\n".join(str(p.get("text", "")) for p in content)}
            flat.append({k: v for k, v in message.items() if v is not None})
        if self.template is None:
            return "\n".join(str(m.get("content", "")) for m in flat)
        kwargs = body.get("chat_template_kwargs") if isinstance(body.get("chat_template_kwargs"), dict) else {}
        return self.template.render(
            **self.special, **kwargs, messages=flat, tools=body.get("tools"),
            add_generation_prompt=body.get("add_generation_prompt", True) is not False)


def token_ids(prompt: Any) -> list[int] | None:
    """A prompt given as token ids (one prompt, not a batch), if it is one."""
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t <= _MAX_TOKEN_ID for t in prompt):
        return prompt
    return None


def _framing(tokenizer: Any, pieces: PieceEncoder) -> tuple[list[int], list[int]] | None:
    """The special tokens the tokenizer adds before and after a completion's prompt (its post-processor's: a BOS,
    say), where they are the same whatever the text; None where they are not (the prompt is then encoded whole)."""
    bare = tokenizer.encode("x", add_special_tokens=False).ids
    full = tokenizer.encode("x", add_special_tokens=True).ids
    starts = [i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare]
    if len(starts) != 1:
        return None
    prefix, suffix = full[:starts[0]], full[starts[0] + len(bare):]
    for text in (*SAMPLES, "It's 3 o'clock", " <|im_start|>x", "東京"):
        if prefix + pieces.encode(text) + suffix != tokenizer.encode(text, add_special_tokens=True).ids:
            return None
    return prefix, suffix


_EXPORT = """
import json, sys
from transformers import AutoTokenizer
t = AutoTokenizer.from_pretrained(sys.argv[1])
template = t.chat_template if isinstance(getattr(t, "chat_template", None), str) else None
special = {k: v for k, v in t.special_tokens_map.items() if isinstance(v, str)}
json.dump({"tokenizer": t.backend_tokenizer.to_str(), "chat_template": template, "special": special}, sys.stdout)
"""


def _export(folder: Path) -> dict[str, Any]:
    """The tokenizer exactly as transformers (which the instances use) builds it, read in a child process."""
    try:
        run = subprocess.run([sys.executable, "-c", _EXPORT, str(folder)], capture_output=True, text=True,
                             timeout=120, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(f"cannot read the tokenizer in {folder}: {exc}") from exc
    if run.returncode != 0:
        raise ValueError(f"cannot read the tokenizer in {folder}: {run.stderr.strip().splitlines()[-1:]}")
    return json.loads(run.stdout)
