"""Logprobs in vLLM's OpenAI shapes, token strings included.

A token's string is its own decode, as vLLM's. A byte-level token that ends inside a UTF-8 character decodes to
text ending in U+FFFD; vLLM then re-decodes it after up to four preceding sampled tokens of the same sequence and
keeps what this token completes, or the empty string when the character is still unfinished. Clients compare
these strings (and chat's `bytes`) with vLLM's, so the same rule is applied here, to the sampled token and to
its alternatives alike (both use the sampled tokens before the position as context).
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.request import TokenLogprobs
from pdserve.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
MAX_CONTEXT = 4  # a UTF-8 character has at most four bytes


class LogprobsFormatter:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def completion(self, logprobs: list[TokenLogprobs], context: list[int], text_offset: int = 0) -> dict[str, Any]:
        """`context`: the sequence's sampled token ids before `logprobs[0]`; `text_offset`: the text before it."""
        tokens, values, tops = [], [], []
        for lp, candidates in self._positions(logprobs, context):
            tokens.append(candidates[lp.token_id][0])
            values.append(candidates[lp.token_id][1])
            # Keyed by string, as vLLM's: alternatives that decode alike collapse, the later one winning.
            tops.append({token: value for token, value in candidates.values()})
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}

    def chat(self, logprobs: list[TokenLogprobs], context: list[int], top: int) -> dict[str, Any]:
        content = []
        for lp, candidates in self._positions(logprobs, context):
            item = _chat_entry(*candidates[lp.token_id])
            # vLLM lists the first `top` candidates in its order: the sampled token first, then the best others.
            item["top_logprobs"] = [_chat_entry(*c) for c in list(candidates.values())[:top]]
            content.append(item)
        return {"content": content}

    def text_length(self, token_ids: list[int]) -> int:
        """How many characters these sampled tokens' strings add up to: a completion's `text_offset` after them."""
        history: list[int] = []
        total = 0
        for token_id in token_ids:
            total += len(self._token(token_id, history))
            history = (history + [token_id])[-MAX_CONTEXT:]
        return total

    def _positions(self, logprobs: list[TokenLogprobs], context: list[int]):
        """Per position: {token_id: (string, logprob)} for the sampled token, then its alternatives best first."""
        history = list(context[-MAX_CONTEXT:])
        for lp in logprobs:
            candidates = {lp.token_id: (self._token(lp.token_id, history), _finite(lp.logprob))}
            for token_id, value in zip(lp.top_ids, lp.top_logprobs, strict=True):
                if token_id not in candidates:
                    candidates[token_id] = (self._token(token_id, history), _finite(value))
            yield lp, candidates
            history = (history + [lp.token_id])[-MAX_CONTEXT:]

    def _token(self, token_id: int, history: list[int]) -> str:
        text = self.tokenizer.token_text(token_id)
        if not text.endswith(_REPLACEMENT):
            return text
        return self._completed_by(token_id, history)

    def _completed_by(self, token_id: int, history: list[int]) -> str:
        """What `token_id` adds after the shortest tail of `history` that makes its last character whole, or ''."""
        decode = self.tokenizer.token_text
        for n in range(1, len(history) + 1):
            tail = history[-n:]
            whole = self.tokenizer.decode(tail + [token_id], skip_special_tokens=False)
            if whole.endswith(_REPLACEMENT):
                continue
            # Context tokens that were themselves unfinished bytes showed as '': their text belongs to this token.
            clean = len(tail)
            while clean > 0 and decode(tail[clean - 1]).endswith(_REPLACEMENT):
                clean -= 1
            prefix = self.tokenizer.decode(tail[:clean], skip_special_tokens=False) if clean else ""
            if whole.startswith(prefix):
                return whole[len(prefix):]
            common = 0
            for a, b in zip(prefix, whole):
                if a != b:
                    break
                common += 1
            return whole[common:]
        return ""


def _chat_entry(token: str, value: float) -> dict[str, Any]:
    return {"token": token, "logprob": value, "bytes": list(token.encode("utf-8", errors="replace"))}


def _finite(value: float) -> float:
    """-inf is not JSON: vLLM (after OpenAI) clamps it to -9999.0."""
    return max(value, -9999.0)
