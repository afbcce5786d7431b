"""The membership record: what every discovery backend says about one instance, typed and versioned.

The same record is an etcd value (JSON), the body of the gateway's `POST /register`, what `pdserve register`
writes for a vLLM instance, and what the Kubernetes backend makes of a pod. It is parsed once, where it enters
(`decode_record`), and the gateway keeps it on its `Instance` (`instance.record`). `kv_events` says where a vLLM
instance publishes its KV-cache events; it is carried verbatim (vLLM's own `--kv-events-config` fields), for the
KV-event subscribers to read.

A record newer than this code (a higher `version`) is still read: new versions only add fields, which decoding
ignores. An incompatible layout would go under another key prefix, not another version number.
"""

from __future__ import annotations

import json
from urllib.parse import quote, urlsplit

import msgspec

from pdserve.server.info import InstanceInfo

RECORD_VERSION = 1
ROLES = ("prefill", "decode", "both", "encode")
# A record in one of these states is no member: the instance said it is leaving (a drain) or not ready (its
# sidecar saw /health fail). Its key goes away with its lease right after; the state says why it left.
READY, DRAINING, NOT_READY = "ready", "draining", "not_ready"
STATES = (READY, DRAINING, NOT_READY)


class RecordError(ValueError):
    """A record that cannot be used: malformed JSON, a wrong type, an unknown role, a URL that is no instance's."""


class KvEvents(msgspec.Struct, frozen=True, kw_only=True):
    """Where an instance publishes KV-cache events (vLLM's `KVEventsConfig` names), as the instance said."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class MemberRecord(msgspec.Struct, frozen=True, kw_only=True):
    version: int = RECORD_VERSION
    url: str  # http://host:port, how gateways reach the instance
    role: str  # prefill, decode, both or encode
    model: str | None = None  # the served model name; a gateway does not route to an instance answering as another
    info: InstanceInfo | None = None  # what its /v1/pdserve/info said when it registered (pdserve instances)
    labels: dict[str, str] = {}
    kv_events: KvEvents | None = None
    state: str = READY
    source: str = ""  # who wrote it: self, sidecar, admin, static, k8s

    @property
    def ready(self) -> bool:
        return self.state == READY


_decode = msgspec.json.Decoder(MemberRecord).decode
_encode = msgspec.json.Encoder().encode


def encode_record(record: MemberRecord) -> bytes:
    return _encode(record)


def decode_record(raw: bytes | str) -> MemberRecord:
    """Parse and check one record; RecordError says what is wrong with it."""
    try:
        record = _decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RecordError(f"not a membership record: {exc}") from None
    return check_record(record)


def check_record(record: MemberRecord) -> MemberRecord:
    """The record with its URL normalised, or RecordError."""
    if record.version < 1:
        raise RecordError(f"record version must be >= 1, got {record.version}")
    if record.role not in ROLES:
        raise RecordError(f"unknown role {record.role!r}; choose one of {', '.join(ROLES)}")
    if record.state not in STATES:
        raise RecordError(f"unknown state {record.state!r}; choose one of {', '.join(STATES)}")
    url = normalise_url(record.url)
    return record if url == record.url else msgspec.structs.replace(record, url=url)


def normalise_url(url: str) -> str:
    url = url.rstrip("/")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or not port or parts.path or parts.query:
        raise RecordError(f"instance URL must look like http://host:port, got {url!r}")
    return url


def member_key(prefix: str, url: str) -> str:
    """The store key of the instance at `url` under `prefix` (one key per URL: a re-registration replaces it)."""
    return f"{prefix.rstrip('/')}/members/{quote(url, safe='')}"


def members_prefix(prefix: str) -> str:
    return f"{prefix.rstrip('/')}/members/"


def kv_events_from_vllm(config: str | dict | None) -> KvEvents | None:
    """`kv_events` from vLLM's `--kv-events-config` JSON: None when events are off or no endpoint is given."""
    if config is None:
        return None
    try:
        data = json.loads(config) if isinstance(config, str) else config
    except ValueError as exc:
        raise RecordError(f"--kv-events-config is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise RecordError("--kv-events-config must be a JSON object")
    # vLLM's defaults: events off, and when on, published by ZMQ on tcp://*:5557 with no replay and no topic.
    if not data.get("enable_kv_cache_events") or data.get("publisher") == "null":
        return None
    endpoint, replay, topic = data.get("endpoint", "tcp://*:5557"), data.get("replay_endpoint"), data.get("topic", "")
    if not isinstance(endpoint, str) or not endpoint:
        raise RecordError("--kv-events-config: 'endpoint' must name where the events are published")
    if (replay is not None and not isinstance(replay, str)) or not isinstance(topic, str):
        raise RecordError("--kv-events-config: 'replay_endpoint' and 'topic' must be strings")
    return KvEvents(endpoint=endpoint, replay_endpoint=replay, topic=topic)
