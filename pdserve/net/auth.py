"""Who may call what, for instances and the gateway alike (pure ASGI: the gateway imports no web framework).

* Client endpoints take vLLM's `--api-key` (or `VLLM_API_KEY`): `Authorization: Bearer <key>`, else a 401
  in OpenAI's error shape. /health, /ping, /load, /version and /metrics stay open, as in vLLM, and so does
  /v1/pdserve/info.
* Admin endpoints (the gateway's /register and /deregister, an instance's /v1/kv/faults) change the cluster:
  they need `--admin-token` (Bearer), or must arrive on `--admin-port`, which listens on loopback only. With
  neither, they are off, and the refusal says how to turn them on. A key for clients is no admin token.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.net.headers import request_header
from pdserve.server.errors import error_body

log = logging.getLogger(__name__)
# /v1/pdserve/info is pdserve's /version (what the instance is): open like it, so that a gateway holding the wrong
# key still learns what it talks to, and can tell its operator the key is wrong instead of calling the instance down.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/load", "/version", "/metrics", "/v1/pdserve/info"})
ADMIN_TOKEN_ENV = "PDSERVE_ADMIN_TOKEN"


def resolve_api_keys(flag: Iterable[str] | str | None) -> tuple[str, ...]:
    """`--api-key` values, else `VLLM_API_KEY`, as vLLM reads them (a config file may give one key as a string)."""
    keys = tuple(k for k in ([flag] if isinstance(flag, str) else flag or ()) if k)
    if keys:
        return keys
    env = os.environ.get("VLLM_API_KEY", "")
    return (env,) if env else ()


def resolve_admin_token(flag: str | None) -> str | None:
    """`--admin-token`, else `PDSERVE_ADMIN_TOKEN` (an environment variable stays out of `ps`)."""
    return flag or os.environ.get(ADMIN_TOKEN_ENV) or None


def bearer_header(key: str | None) -> list[tuple[bytes, bytes]]:
    """The header an outgoing request carries to reach an upstream that has an API key."""
    return [(b"authorization", b"Bearer " + key.encode())] if key else []


class Tokens:
    """Bearer tokens compared in constant time (by digest, so lengths do not leak either)."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self._digests = [hashlib.sha256(t.encode()).digest() for t in tokens]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def accepts(self, authorization: bytes | None) -> bool:
        scheme, _, value = (authorization or b"").partition(b" ")
        if scheme.lower() != b"bearer" or not value:
            return False
        digest = hashlib.sha256(value.strip()).digest()
        match = False
        for known in self._digests:
            match |= secrets.compare_digest(known, digest)
        return match


@dataclass(frozen=True)
class AccessPolicy:
    api_keys: tuple[str, ...] = ()
    admin_token: str | None = None
    admin_port: int | None = None  # the bound port of the loopback admin listener
    admin_paths: frozenset[str] = frozenset()


class AccessRules:
    """API key for client endpoints, admin rules for admin ones: what a request is refused for, if anything."""

    def __init__(self, policy: AccessPolicy) -> None:
        self.policy = policy
        self.keys = Tokens(policy.api_keys)
        self.admin = Tokens([policy.admin_token] if policy.admin_token else [])

    def refusal(self, scope: dict) -> tuple[int, str] | None:
        """(status, message) for an HTTP request these rules refuse; None for one they let through (and OPTIONS,
        a CORS preflight, which carries no credentials)."""
        if scope["method"] == "OPTIONS":
            return None
        path = scope["path"]
        if path in self.policy.admin_paths:
            refusal = self._admin_refusal(scope)
            if refusal is not None:
                log.warning("refused admin %s %s from %s: %s", scope["method"], path, peer(scope), refusal[1])
            return refusal
        if self._on_admin_port(scope):
            return (None if path in PUBLIC_PATHS else
                    (404, f"the admin port serves only {', '.join(sorted(self.policy.admin_paths))}"))
        if self.keys and path not in PUBLIC_PATHS and not self.keys.accepts(request_header(scope, b"authorization")):
            return 401, "invalid or missing API key: send 'Authorization: Bearer <api key>'"
        return None

    def _admin_refusal(self, scope: dict) -> tuple[int, str] | None:
        if self.admin:
            if self.admin.accepts(request_header(scope, b"authorization")):
                return None
            return 401, "admin endpoint: send 'Authorization: Bearer <admin token>' (the --admin-token)"
        if self._on_admin_port(scope):
            return None
        if self.policy.admin_port is not None:
            return 403, f"admin endpoints are served on the admin port only (127.0.0.1:{self.policy.admin_port})"
        return 403, ("admin endpoints are disabled: start with --admin-token TOKEN (then send 'Authorization: "
                     "Bearer TOKEN') or --admin-port PORT (served on 127.0.0.1 only)")

    def _on_admin_port(self, scope: dict) -> bool:
        server = scope.get("server")
        return self.policy.admin_port is not None and server is not None and server[1] == self.policy.admin_port


class AccessGuard:
    """The rules as ASGI middleware in front of a whole app (an instance's). The gateway's own app asks them
    directly, one coroutine fewer on the path of every request."""

    def __init__(self, app: Any, policy: AccessPolicy) -> None:
        self.app = app
        self.rules = AccessRules(policy)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        refusal = self.rules.refusal(scope) if scope["type"] == "http" else None
        if refusal is not None:
            await refuse(send, *refusal)
            return
        await self.app(scope, receive, send)


def peer(scope: dict) -> str:
    """The caller's address, for the audit log, and whom a proxy says it forwarded for (X-Forwarded-For, read here
    rather than by a middleware on every request: the gateway serves without uvicorn's)."""
    client = scope.get("client")
    address = f"{client[0]}:{client[1]}" if client else "unknown"
    forwarded = b", ".join(value for key, value in scope["headers"] if key == b"x-forwarded-for")
    return f"{address} (x-forwarded-for: {forwarded[:256].decode('latin-1')})" if forwarded else address


async def refuse(send: Any, status: int, message: str) -> None:
    body = msgspec.json.encode(error_body(status, message))
    headers = [(b"content-type", b"application/json")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
