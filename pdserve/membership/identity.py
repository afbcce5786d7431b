"""What a gateway asks an instance about its membership: which model it serves, and whether it is draining.

A record says which model its instance serves; the gateway checks that the address answers as that model
(`GET /v1/models`, which vLLM and pdserve both serve) before routing there, since a stale or mistaken record would
otherwise send users' prompts to another model. A draining instance says so on `/health` with a header, so that
a gateway stops giving it work at its next probe even when no store tells it (flags, a static fleet).
"""

from __future__ import annotations

import msgspec

from pdserve.net.http_client import HttpPool, UpstreamError, UpstreamTimeout

DRAINING_HEADER = b"pdserve-draining"


class _Model(msgspec.Struct):
    id: str


class _Models(msgspec.Struct):
    data: list[_Model]


_decode_models = msgspec.json.Decoder(_Models).decode


async def served_model(pool: HttpPool) -> str | None:
    """The first model id the instance lists, or None when it cannot say (unreachable, unreadable, none)."""
    try:
        response = await pool.request("GET", "/v1/models", connect_timeout=1.0, header_timeout=2.0)
        body = await response.read(timeout=2.0)
    except (UpstreamError, UpstreamTimeout, OSError):
        return None
    if response.status != 200:
        return None
    try:
        models = _decode_models(body).data
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return models[0].id if models else None
