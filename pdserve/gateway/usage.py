"""The usage a client gets for a request P prefilled and D decoded: prompt and cached tokens from P (the prompt's
cache hits happened there), completion tokens from D. Only the `usage` object of D's answer is rewritten; the rest
goes out as D wrote it."""

from __future__ import annotations

from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.decode
# An answer's top-level fields, each kept as its JSON text: checked, not built (only `usage` is read).
_decode_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_MISSING = object()


def _counts(prefill: dict[str, Any], decode: dict[str, Any]) -> tuple[Any, Any, Any]:
    """What the merge reports: P's prompt count (D's when P gives none), D's completion count, and P's cache hits
    (_MISSING when P reports none: details stay as the backends sent them, since vLLM sends null unless it runs
    with --enable-prompt-tokens-details, and a client must see that null, not an invented zero)."""
    details = prefill.get("prompt_tokens_details")
    cached = details["cached_tokens"] if isinstance(details, dict) and "cached_tokens" in details else _MISSING
    return prefill.get("prompt_tokens", decode.get("prompt_tokens", 0)), decode.get("completion_tokens", 0), cached


def merged_usage(prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    prompt, completion, cached = _counts(prefill, decode)
    merged = {**decode, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not _MISSING:
        merged["prompt_tokens_details"] = {**(decode.get("prompt_tokens_details") or {}), "cached_tokens": cached}
    return merged


def adds_nothing(prefill: dict[str, Any], decode: dict[str, Any]) -> bool:
    """`merged_usage(prefill, decode) == decode`, without building the merge: true of most answers (P and D count
    the same prompt), so they are passed on without writing anything."""
    prompt, completion, cached = _counts(prefill, decode)
    if (decode.get("prompt_tokens", _MISSING) != prompt or decode.get("completion_tokens", _MISSING) != completion
            or decode.get("total_tokens", _MISSING) != prompt + completion):
        return False
    if cached is _MISSING:
        return True
    mine = decode.get("prompt_tokens_details")
    return isinstance(mine, dict) and mine.get("cached_tokens", _MISSING) == cached


def merge_answer(prefill_usage: dict[str, Any] | None, raw: bytes) -> bytes:
    """D's JSON answer with P's counts. Parsing the whole answer and writing it again was the costliest thing the
    gateway did with one: its `usage` alone is parsed, and when P's counts change nothing, D's bytes go out."""
    if prefill_usage is None:
        return raw
    try:
        fields = _decode_fields(raw)
        usage = _decode(fields["usage"]) if "usage" in fields else None
    except msgspec.DecodeError:  # not JSON, or not an object (a ValidationError is one)
        return raw
    try:
        if not isinstance(usage, dict) or adds_nothing(prefill_usage, usage):
            return raw
        fields["usage"] = msgspec.Raw(_encode(merged_usage(prefill_usage, usage)))
    except TypeError:  # a count that is no number: nothing to add it to
        return raw
    return _encode(fields)


def merge_events(prefill_usage: dict[str, Any] | None, events: bytes) -> bytes:
    """Whole SSE events from D, the one that carries usage (a stream's last, when asked for) with P's counts."""
    # `find`, not `in`: CPython's `bytes in bytes` raises and clears a TypeError first (the int case) each time.
    if prefill_usage is None or events.find(b'"usage"') < 0:
        return events
    out = []
    for event in events.split(b"\n\n"):
        if event.startswith(b"data: {") and _carries_usage(event):
            event = b"data: " + merge_answer(prefill_usage, event[6:])
        out.append(event)
    return b"\n\n".join(out)


def _carries_usage(event: bytes) -> bool:
    """Only events with a usage object are parsed; most chunks have none, or `"usage": null`."""
    at = event.find(b'"usage"')
    return at >= 0 and event[at + 7:at + 16].lstrip(b": ").startswith(b"{")
