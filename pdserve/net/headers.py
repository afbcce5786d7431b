"""Response headers bounded to what common clients read: every header pdserve writes (instance and gateway).

HTTP clients refuse long headers outright (httpx/h11: 16 KiB for the whole head, "Receive buffer too long"; curl:
100 KiB per line, "Out of memory"; Node: 16 KiB), and the client then loses an answer the server computed. A list
that may grow with the request (one internal id per prompt and sample) is written as the whole ids that fit, with
the count of those left out in a second header; the full list is in the request's timeline
(`GET /v1/timeline/{X-Request-Id}`, one timeline per internal id). Anything else over the bound is cut and logged,
never sent whole.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# A few KiB per header, so that even several of them stay far below 16 KiB for the whole head.
MAX_HEADER_VALUE_BYTES = 4096


def bounded_list(values: list[str], limit: int = MAX_HEADER_VALUE_BYTES) -> tuple[str, int]:
    """`values` comma-joined, as many whole ones as fit in `limit` bytes; and how many were left out."""
    size, kept = -1, 0
    for value in values:
        size += len(value) + 1
        if size > limit:
            break
        kept += 1
    return ",".join(values[:kept]), len(values) - kept


def bound_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers with any value over the bound cut to it (the caller found one)."""
    out = []
    for key, value in headers:
        if len(value) > MAX_HEADER_VALUE_BYTES:
            log.warning("response header %s is %d bytes long: cut to %d", key.decode("latin-1"), len(value),
                        MAX_HEADER_VALUE_BYTES)
            value = value[:MAX_HEADER_VALUE_BYTES]
        out.append((key, value))
    return out
