"""Encoding a rendered chat prompt piece by piece, with the pieces remembered.

A tokenizer cuts its input at its added tokens (`<|im_start|>`, `<|im_end|>`, ...) before it normalizes or
pre-tokenizes anything, so the text between two of them encodes the same wherever it stands. A chat prompt is
mostly pieces seen before (the system prompt, the earlier turns of a conversation): remembering each piece's ids
makes the gateway encode only what is new, which is what keeps routing by token ids as cheap as routing blindly.
Some tokenizers do look across the cut (added tokens that strip the spaces beside them, a prefix space added only
at the very start): a self-test at startup compares piecewise and whole encodings and turns the memory off where
they differ.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.kv_events.lazy_ids import LazyIds, cuts_agree
from pdserve.modelgen.tokenizer import corpus_text

SAMPLES = ("Hello there!\n How are you?  ", " leading space", "tabs\tand\n\nnew lines ", "x")


def corpus() -> str:
    """Varied prose in many scripts, for the tokenizer self-tests: the start of the packaged corpus."""
    return corpus_text()[:20_000]


class PieceEncoder:
    def __init__(self, tokenizer: Any, capacity: int = 20_000,
                 ordinary: Callable[[str], list[int]] | None = None) -> None:
        """`ordinary`: encodes text with no added token in it as `tokenizer` does, faster (fast_bpe.py)."""
        self.tokenizer = tokenizer
        self.capacity = capacity
        self._ordinary = ordinary or (lambda text: tokenizer.encode(text, add_special_tokens=False).ids)
        added = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
        exact = all(not (t.lstrip or t.rstrip or t.normalized) for t in tokenizer.get_added_tokens_decoder().values())
        self._ids = added
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")") \
            if added else None
        self._memory: OrderedDict[str, list[int]] = OrderedDict()
        self.enabled = exact and self._split is not None and self._self_test()
        self.lazy_ok = self.enabled and cuts_agree(self._ordinary, corpus())

    def encode(self, text: str) -> list[int]:
        """`text`'s ids without special tokens added around it (the chat template placed them)."""
        if not self.enabled:
            if self._split is None:  # no added token to cut out: all of it is ordinary text
                return self._ordinary(text)
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        out: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:
                out.append(self._ids[piece])
            elif piece:
                ids = self.remembered(piece)
                if ids is None:
                    ids = self.ordinary(piece)
                    self.remember(piece, ids)
                out.extend(ids)
        return out

    def lazy(self, text: str, prefix: Sequence[int] = (), suffix: Sequence[int] = ()) -> LazyIds | None:
        """`text`'s ids encoded only as far as they are asked for (lazy_ids.py), between `prefix` and `suffix`;
        None where that could differ."""
        return LazyIds(self, text, prefix, suffix) if self.lazy_ok else None

    # -- what LazyIds reads -------------------------------------------------------------------------------
    def split(self, text: str) -> list[str]:
        """Ordinary text and added tokens, alternating (the first and last are ordinary, maybe empty)."""
        return self._split.split(text)

    def added_id(self, token: str) -> int:
        return self._ids[token]

    def ordinary(self, text: str) -> list[int]:
        return self._ordinary(text)

    def remembered(self, piece: str) -> list[int] | None:
        ids = self._memory.get(piece)
        if ids is not None:
            self._memory.move_to_end(piece)
        return ids

    def remember(self, piece: str, ids: list[int]) -> None:
        self._memory[piece] = ids
        if len(self._memory) > self.capacity:
            self._memory.popitem(last=False)

    def _self_test(self) -> bool:
        self.enabled = True
        specials = list(self._ids)
        for a in SAMPLES:
            for b in SAMPLES:
                for special in specials[:3]:
                    text = a + special + b + special
                    if self.encode(text) != self.tokenizer.encode(text, add_special_tokens=False).ids:
                        self._memory.clear()
                        return False
        self._memory.clear()
        return True
