"""The gateway's admin endpoints: `POST /register` and `POST /deregister` change who answers users, so each one
is logged with the caller's address, and an instance URL must point somewhere an instance can live.

Who may call them at all is decided before (pdserve/net/auth.py: an admin token or the loopback admin port).
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

import msgspec

from pdserve.gateway.registry import Instance
from pdserve.membership.etcd_client import EtcdError
from pdserve.membership.record import MemberRecord, check_record
from pdserve.net.addresses import resolve
from pdserve.net.auth import peer
from pdserve.net.json_body import decode_object
from pdserve.server.errors import error_body

log = logging.getLogger(__name__)
ADMIN_PATHS = frozenset({"/register", "/deregister"})


async def refused_target(url: str) -> str | None:
    """Why an instance URL may not be registered, or None. Link-local addresses are where cloud metadata
    services answer (169.254.169.254), multicast and unspecified ones are no instance: the gateway would send
    them users' prompts and probe them on a registrant's behalf."""
    parts = urlsplit(url)
    if not parts.hostname:
        return None  # malformed: the registry says how
    try:
        addresses = await resolve(parts.hostname, parts.port)
    except OSError as exc:
        return f"cannot resolve {parts.hostname!r}: {exc}"
    for ip in addresses:
        for kind in ("link_local", "multicast", "unspecified"):
            if getattr(ip, f"is_{kind}"):
                return f"{parts.hostname} is a {kind.replace('_', '-')} address ({ip}); instances cannot live there"
    return None


async def membership(gateway: Any, scope: dict, body: bytes, path: str) -> tuple[int, dict[str, Any]]:
    """Apply one register/deregister request; returns (status, JSON body). With a store (etcd), the change is
    written through to it, so every gateway following the store sees it."""
    try:
        data = decode_object(body)
        url = data.get("url")
        if not isinstance(url, str):
            raise TypeError("url must be a string")
        if path == "/deregister":
            removed = await gateway.membership.deregister(url)
            log.info("admin: %s deregistered %s (%s)", peer(scope), url, "removed" if removed else "not registered")
            return (200 if removed else 404), {"url": url, "removed": removed}
        record = registration(data)
        why = await refused_target(record.url)
        if why is not None:
            log.warning("admin: %s tried to register %s %s: refused, %s", peer(scope), record.role, url, why)
            return 400, _error(f"refused {url}: {why}")
        await gateway.membership.register(record)
    except (TypeError, ValueError) as exc:  # a BodyError, a malformed record, the registry refusing the URL
        return 400, _error(f"expected {{\"url\": ..., \"role\": ...}}: {exc}")
    except EtcdError as exc:
        return 503, error_body(503, f"the membership store did not take the registration: {exc}")
    log.info("admin: %s registered %s instance %s", peer(scope), record.role, record.url)
    instance = gateway.registry.instances.get(record.url)
    if instance is None:
        return 200, {"url": record.url, "role": record.role, "healthy": False, "kind": None}
    await gateway.registry.probe_all()
    return 200, {"url": instance.url, "role": instance.role, "healthy": instance.healthy, "kind": kind(instance)}


def registration(data: dict[str, Any]) -> MemberRecord:
    """The record a `/register` body describes: url, role (default both), and optionally model, labels and
    kv_events (where the instance publishes KV-cache events)."""
    fields = {"role": "both", **{k: data[k] for k in ("url", "role", "model", "labels", "kv_events") if k in data}}
    try:
        return check_record(msgspec.convert({**fields, "source": "admin"}, MemberRecord))
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None


def kind(instance: Instance) -> str | None:
    """What the instance is (engine, version, connector, protocols), once it has said."""
    return instance.caps.describe() if instance.caps is not None else None


def _error(message: str) -> dict[str, Any]:
    return error_body(400, message)
