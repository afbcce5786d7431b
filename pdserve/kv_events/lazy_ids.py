"""A rendered prompt's token ids, encoded only as far as routing asks for them.

Routing reads a prompt's blocks from its start and stops at the first block that no instance holds and nothing is
credited with: past it, no instance's cached run can go on, and a prompt that shares nothing with any cache (most
of a workload of unique prompts) needs no more than its first block or two. Encoding the rest of such a prompt at
the gateway was most of what routing by token ids cost over routing blindly.

A byte-level BPE splits its text with a regex before it merges anything, and the usual ones (GPT-2's, Llama 3's,
Qwen's) always split at a space between two letters: the ids of the text up to such a space and of the text from
it, put together, are the ids of the whole. So a long piece (the text between two added tokens, pieces.py) is
encoded a head at a time, each head ending at such a space. A self-test at startup checks that property on varied
text for the tokenizer at hand (`cuts_agree`); where it fails, prompts are encoded whole, as before.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

# A space between two letters (neither a digit nor "_"): where the byte-level pre-tokenizers split anyway.
_CUT = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")
_CHARS_PER_ID = 4  # a head long enough for the ids asked for, on text of ~1-4 characters an id; grown if short
_PER_CHAR = 0.3  # ids a character, before any is encoded (only a load estimate reads it)


class LazyIds:
    """The ids of `text`, between the special tokens given to go around it, encoded head by head through
    `encoder`."""

    __slots__ = ("ids", "_encoder", "_parts", "_next", "_piece", "_rest", "_head", "_read", "_size", "_suffix")

    def __init__(self, encoder: Any, text: str, prefix: Sequence[int] = (), suffix: Sequence[int] = ()) -> None:
        """`encoder`: a PieceEncoder whose cuts agree (`lazy_ok`). `prefix`, `suffix`: ids around the text's own (the
        special tokens a tokenizer adds to a completion's prompt)."""
        self.ids: list[int] = list(prefix)
        self._suffix: Sequence[int] | None = suffix  # None once added
        self._encoder = encoder
        self._parts = encoder.split(text)  # ordinary text and added tokens, alternating
        self._next = 0
        self._piece = ""  # the ordinary piece being encoded head by head, and what of it is left
        self._rest = ""
        self._head: list[int] = []
        self._read = 0  # characters encoded
        self._size = len(text)

    @property
    def complete(self) -> bool:
        return self._suffix is None

    def ensure(self, count: int | None) -> None:
        """At least `count` ids, or all of them (`None`: all); and past them, what costs no encoding (added tokens,
        pieces remembered), up to the next piece that would."""
        ids, parts, encoder = self.ids, self._parts, self._encoder
        while True:
            if self._rest:
                if count is not None and len(ids) >= count:
                    return
                self._encode_head(None if count is None else count - len(ids))
                continue
            i = self._next
            if i >= len(parts):
                if self._suffix is not None:
                    ids.extend(self._suffix)
                    self._suffix = None
                return
            part = parts[i]
            if i % 2:
                ids.append(encoder.added_id(part))
            elif part:
                known = encoder.remembered(part)
                if known is None:
                    if count is not None and len(ids) >= count:
                        return
                    self._piece, self._rest, self._head = part, part, []
                    self._next = i + 1
                    continue
                ids.extend(known)
            self._next = i + 1
            self._read += len(part)

    def finish(self) -> list[int]:
        self.ensure(None)
        return self.ids

    def estimate(self) -> int:
        """The whole prompt's ids: exact once complete, else the ids so far and the rest at their rate."""
        if self.complete:
            return len(self.ids)
        per_char = len(self.ids) / self._read if self._read else _PER_CHAR
        return len(self.ids) + round((self._size - self._read) * per_char) + len(self._suffix)

    def _encode_head(self, wanted: int | None) -> None:
        """The next head of the piece being read: enough for `wanted` more ids (None: all of it). Heads at least
        double, so a piece read to its end is encoded in a few calls."""
        text = self._rest
        cut = None if wanted is None else _CUT.search(text, max(wanted, len(self._head)) * _CHARS_PER_ID)
        chunk, self._rest = (text[:cut.start()], text[cut.start():]) if cut else (text, "")
        ids = self._encoder.ordinary(chunk)
        self._read += len(chunk)
        self.ids.extend(ids)
        self._head.extend(ids)
        if not self._rest:
            self._encoder.remember(self._piece, self._head)


def cuts_agree(ordinary: Any, corpus: str) -> bool:
    """Whether `ordinary` (ordinary text to ids) encodes text cut at a space between two letters as it encodes it
    whole, on varied text: windows of `corpus` (prose in many scripts), cut at such spaces."""
    texts = [corpus[i:i + 160] for i in range(0, len(corpus), 160)]
    texts += ["It's 3 o'clock: don't go", "naïve café Ünïcödé e\u0301 x", "東京 and Привет мир", "tabs\tand  two  spaces"]
    for text in texts:
        whole = ordinary(text)
        for cut in list(_CUT.finditer(text))[:3]:
            at = cut.start()
            if ordinary(text[:at]) + ordinary(text[at:]) != whole:
                return False
    return True
