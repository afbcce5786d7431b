"""Identifiers that cross boundaries (the two id domains of docs/design.md, section 2).

Three kinds of ids live in pdserve and must never be mixed up, so each has its own type:

* the external request id: the client's ``X-Request-Id`` (or one the gateway minted); same on every leg;
* ``ReqId``: an instance's internal id, the external id plus a random suffix, so that P and D never share one;
* ``TransferId``: minted once per attempt by the gateway, shared by every leg, used by everything that crosses
  instances (side-channel messages, transfer bookkeeping).
"""

from __future__ import annotations

import os
import secrets
import uuid
from typing import NewType

ReqId = NewType("ReqId", str)
TransferId = NewType("TransferId", str)
EngineId = NewType("EngineId", str)

TRANSFER_ID_PREFIX = "xfer-"


def new_external_request_id() -> str:
    """128 random bits in hex (uuid4().hex's shape, at a third of its cost: every request without an id mints one)."""
    return os.urandom(16).hex()


def make_internal_request_id(external_id: str) -> ReqId:
    """The external id plus a random suffix, as vLLM does since its PR 27987."""
    return ReqId(f"{external_id}-{secrets.token_hex(4)}")


def new_transfer_id() -> TransferId:
    """`xfer-` and 128 random bits in a UUID's dashed hex (formatted here: str(uuid4()) costs ~5x more, on every
    attempt of every gateway request)."""
    h = os.urandom(16).hex()
    return TransferId(f"{TRANSFER_ID_PREFIX}{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")


def new_engine_id() -> EngineId:
    return EngineId(str(uuid.uuid4()))


MAX_REQUEST_ID_LENGTH = 256
# P hands D its own internal id as `remote_request_id`: an engine builds it from the external id, longer by a prefix
# ("chatcmpl-"), a prompt index, a sample prefix and a random suffix (pdserve and vLLM alike), so a decode instance
# must take ids well past MAX_REQUEST_ID_LENGTH. vLLM does not bound the X-Request-Id it builds them from; this bound
# is the size of a request header line common HTTP servers accept (8 KiB), plus room for what an engine adds.
MAX_REMOTE_REQUEST_ID_LENGTH = 8192 + 64


def clean_request_id(value: str | None) -> str | None:
    """A client-supplied request id made safe to echo in headers, logs and JSON: printable ASCII without spaces,
    at most MAX_REQUEST_ID_LENGTH characters; None when nothing usable is left (a fresh id is minted then)."""
    if not value:
        return None
    cleaned = "".join(c for c in value[:4 * MAX_REQUEST_ID_LENGTH] if "!" <= c <= "~")[:MAX_REQUEST_ID_LENGTH]
    return cleaned or None
