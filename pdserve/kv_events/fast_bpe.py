"""A byte-level BPE tokenizer.json run by tiktoken, where the two encode alike.

Tokenizing a prompt the gateway has not seen is a large part of what routing by token ids costs: the fast
tokenizer spends about 1.5 µs a token on a 2-core Xeon, tiktoken about a fifth of that on the same text. Most of
the field's vocabularies are byte-level BPE (GPT-2's, Llama 3's, Qwen's): a pre-tokenizer regex, then merges over
the bytes. tiktoken runs the same algorithm with one difference: it merges by the rank of the merged token where
the fast tokenizer merges by the merge list's order. The two agree when the merge list's results come in id order
(vocabularies trained by BPE; tiktoken's own converted to tokenizer.json, which list every split of a token).
Anything else (a normalizer other than NFC, a sentencepiece-style pre-tokenizer, byte fallback, subword prefixes,
dropout, a byte missing from the vocabulary, merges out of order) keeps the fast tokenizer. A self-test on varied
text checks the result against the fast tokenizer before it is used.

Only ordinary text goes through it: added tokens are cut out first (pieces.py), and a disagreement on some rare
text would only cost a routing credit, never an answer (the instances tokenize for themselves).
"""

from __future__ import annotations

import json
import logging
import unicodedata
from collections.abc import Callable
from typing import Any

from pdserve.kv_events.pieces import SAMPLES, corpus

logger = logging.getLogger(__name__)

# The fast tokenizer's ByteLevel pre-tokenizer with use_regex: GPT-2's split.
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The pieces' self-test texts, and what a byte-level split treats apart: digits, contractions, scripts, emoji,
# combining marks, runs of whitespace.
_SAMPLES = (*SAMPLES, "", "   ", "It's 3.14159 o'clock; we'll see—won't we?",
            "Ünïcödé: naïve café, 東京, Привет, 😀👍🏽 e\u0301", "snake_case + CamelCase = 12345678901234567890",
            "  \n\n\t  multiple   spaces\r\n", "'S 'LL 'Ve")


def fast_encoder(tokenizer: Any) -> Callable[[str], list[int]] | None:
    """`tokenizer` (a `tokenizers.Tokenizer`)'s encoding of ordinary text without special tokens, by tiktoken; None
    where tiktoken is missing or would not encode as the tokenizer does."""
    try:
        import tiktoken
    except ImportError:
        return None
    spec = json.loads(tokenizer.to_str())
    reason, built = _convert(spec)
    if built is None:
        logger.info("prompt tokens at the gateway: the fast tokenizer (%s)", reason)
        return None
    pattern, ranks, normalize = built
    try:
        encoding = tiktoken.Encoding("pdserve-routing", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    except Exception as exc:  # noqa: BLE001 - a pattern tiktoken's regex engine rejects: keep the fast tokenizer
        logger.info("prompt tokens at the gateway: the fast tokenizer (tiktoken refused it: %s)", exc)
        return None
    ordinary = encoding.encode_ordinary
    encode = ordinary if normalize is None else (lambda text: ordinary(normalize(text)))
    for text in (*_SAMPLES, corpus()):
        if encode(text) != tokenizer.encode(text, add_special_tokens=False).ids:
            logger.info("prompt tokens at the gateway: the fast tokenizer (tiktoken differs on %r)", text[:40])
            return None
    logger.info("prompt tokens at the gateway: tiktoken (the self-test matched the fast tokenizer)")
    return encode


def _convert(spec: dict[str, Any]) -> tuple[str, tuple[str, dict[bytes, int], Callable[[str], str] | None] | None]:
    """(why not, None) or ("", (pre-tokenizer regex, ranks, normalizer))."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"a {model.get('type')} model, not BPE", None
    if model.get("byte_fallback") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") \
            or model.get("dropout"):
        return "BPE options tiktoken lacks", None
    normalizer = spec.get("normalizer")
    if normalizer is None:
        normalize = None
    elif normalizer.get("type") == "NFC":
        normalize = _nfc
    else:
        return f"a {normalizer.get('type')} normalizer", None
    pattern = _pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        return "not a byte-level pre-tokenizer", None
    alphabet = _byte_alphabet()
    added = {t["id"] for t in spec.get("added_tokens") or ()}
    ranks: dict[bytes, int] = {}
    for token, token_id in model.get("vocab", {}).items():
        if token_id in added:
            continue
        if any(ch not in alphabet for ch in token):
            return "a vocabulary entry outside the byte-level alphabet", None
        ranks[bytes(alphabet[ch] for ch in token)] = token_id
    if any(bytes([b]) not in ranks for b in range(256)):
        return "a byte missing from the vocabulary", None
    vocab, last = model["vocab"], -1
    for merge in model.get("merges", ()):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = vocab.get(left + right)
        if merged is None or merged < last:
            return "merges whose results are not in id order", None
        last = merged
    return "", (pattern, ranks, normalize)


def _pattern(pre: dict[str, Any] | None) -> str | None:
    """The split regex of a byte-level pre-tokenizer: ByteLevel's own (GPT-2's), or a Split before a ByteLevel
    that does not split again (Llama 3's, Qwen's)."""
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        plain = not pre.get("add_prefix_space", False) and pre.get("use_regex", True)
        return _GPT2_PATTERN if plain else None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, level = steps
    regex = (split.get("pattern") or {}).get("Regex")
    if (split.get("type") != "Split" or regex is None or split.get("behavior") != "Isolated" or split.get("invert")
            or level.get("type") != "ByteLevel" or level.get("use_regex", True) or level.get("add_prefix_space")):
        return None
    return regex


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, as byte-level vocabularies spell their tokens."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in kept}
    shifted = 0
    for b in range(256):
        if b not in kept:
            alphabet[chr(256 + shifted)] = b
            shifted += 1
    return alphabet


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)
