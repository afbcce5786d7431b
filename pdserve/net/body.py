"""Request bodies read under a size limit, for both kinds of process (instance and gateway).

A declared Content-Length over the limit is refused before a byte of the body is read; a chunked upload (no
Content-Length) is counted as it streams and refused at the first chunk past the limit. Either way no more than
the limit is ever held in memory, and the server discards the rest of the upload without buffering it.
"""

from __future__ import annotations

from typing import Any

from pdserve.net.headers import request_header

# 32 MiB, as common reverse proxies allow: a few photos as base64 data URLs (a 4 MB JPEG is ~5.3 MB encoded)
# fit with room to spare, while a text prompt that long is already far past any context window.
DEFAULT_MAX_BODY_BYTES = 32 << 20


class BodyTooLarge(Exception):
    """The body is over the limit; the server answers 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body larger than {limit} bytes (the server's --max-request-body-bytes)")


def declared_length(scope: dict[str, Any]) -> int | None:
    value = request_header(scope, b"content-length")
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


async def read_body(scope: dict[str, Any], receive: Any, limit: int) -> bytes:
    """The whole body of an ASGI request; `BodyTooLarge` past `limit`, `ConnectionAbortedError` if the client
    left first."""
    length = declared_length(scope)
    if length is not None and length > limit:
        raise BodyTooLarge(limit)
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)
