"""`ec_transfer_params`, the typed contract between encode instances and the instances that load their outputs.

The wire form is a JSON object keyed by mm_hash; each entry says the encode instance holds that item's encoder
output (``do_remote_encode: true``), which connector stored it, how many embeddings it has and their checksum,
and, for the peer-to-peer connector, where to fetch it (``remote_host``, ``remote_port``, ``remote_engine_id``)
with the capability ``token``. The server parses a body's params once, where it reads the request; the encode
instance's answer is written by `ECSource.to_wire`, and the gateway passes entries through untouched.

Loads are optimistic, so parsing is lenient: an entry that does not claim ``do_remote_encode`` is ignored (the
item is encoded locally), and one with a malformed field keeps the reason, so its load fails and the item is
encoded locally, as any failed load is. This module imports no torch: the gateway may use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ECSource:
    """Where an encode instance keeps one item's encoder output, and what the output must look like."""

    connector: str = ""
    num_embeds: int | None = None
    checksum: int | None = None  # None: trust the checksum stored with the output
    host: str | None = None  # peer-to-peer only, as are port, engine_id and token
    port: int | None = None
    engine_id: str | None = None
    token: str = ""
    error: str | None = None  # why this entry cannot be loaded (a malformed field); set by parsing only

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"do_remote_encode": True, "connector": self.connector, "num_embeds": self.num_embeds,
                                "checksum": self.checksum}
        if self.host is not None:
            wire.update(remote_host=self.host, remote_port=self.port, remote_engine_id=self.engine_id,
                        token=self.token)
        return wire


def _int(entry: dict[str, Any], key: str, digits: bool = False) -> int | None:
    value = entry.get(key)
    if value is None:
        return None
    if digits and isinstance(value, str) and value.isdigit():
        value = int(value)  # some proxies send port numbers as strings
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"ec_transfer_params {key} must be an integer, got {value!r}")
    return value


def _source(entry: dict[str, Any]) -> ECSource:
    host = entry.get("remote_host")
    try:
        return ECSource(connector=str(entry.get("connector") or ""), num_embeds=_int(entry, "num_embeds"),
                        checksum=_int(entry, "checksum"), host=None if host is None else str(host),
                        port=_int(entry, "remote_port", digits=True), engine_id=entry.get("remote_engine_id"),
                        token=str(entry.get("token", "")))
    except ValueError as exc:
        return ECSource(error=str(exc))


def parse_ec_params(params: Any) -> dict[str, ECSource]:
    """The items an encode instance holds, by mm_hash; anything else in the params is ignored."""
    if not isinstance(params, dict):
        return {}
    return {mm_hash: _source(entry) for mm_hash, entry in params.items()
            if isinstance(entry, dict) and entry.get("do_remote_encode")}
