"""Response headers bounded to what common clients read: every header pdserve writes (instance and gateway).

HTTP clients refuse long headers outright (httpx/h11: 16 KiB for the whole head, "Receive buffer too long"; curl:
100 KiB per line, "Out of memory"; Node: 16 KiB), and the client then loses an answer the server computed. A list
that may grow with the request (one internal id per prompt and sample) is written as the whole ids that fit, with
the count of those left out in a second header; the full list is in the request's timeline
(`GET /v1/timeline/{X-Request-Id}`, one timeline per internal id). Anything else over the bound is cut and logged,
never sent whole.

Request headers are read here too, by name, from one dict per request (`request_header`).
"""

from __future__ import annotations

import logging
from operator import itemgetter
from typing import Any

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


_value = itemgetter(1)


def over_bound(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether any value is over the bound: one pass in C, since every response asks."""
    return bool(headers) and max(map(len, map(_value, headers))) > MAX_HEADER_VALUE_BYTES


# Where a request's headers, by name, are kept in its ASGI scope once some layer asked for one.
HEADER_MAP_KEY = "pdserve.headers"


def request_header(scope: dict[str, Any], name: bytes) -> bytes | None:
    """A request header by its lower-case name (the first, if the client repeated it).

    The front, the access guard, the body limit and the gateway's route each read one or two headers of every
    request: a dict made once in C, on the first ask, instead of a scan of the list by each of them.
    """
    found = scope.get(HEADER_MAP_KEY)
    if found is None:
        found = scope[HEADER_MAP_KEY] = dict(reversed(scope["headers"]))
    return found.get(name)


def set_request_headers(scope: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> None:
    """Replace the request's headers (a layer cleaned them): what `request_header` reads follows."""
    scope["headers"] = headers
    scope.pop(HEADER_MAP_KEY, None)
