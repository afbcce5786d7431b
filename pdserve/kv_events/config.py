"""`--kv-events-config`, read as vLLM reads it, and where a gateway dials a publisher.

vLLM's rule for the endpoints: one holding `*`, `::`, `ipc://` or `inproc://` is bound, anything else is
connected (so a collector may bind and publishers connect to it). Like vLLM 0.32's `tcp://*:0`, port 0 binds an
ephemeral port on the instance's own address (pdserve's `--host`, vLLM's node IP), so several instances on one
host need no port plan; the ports taken are what the instance advertises.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import msgspec

PUBLISHERS = ("zmq", "null")


class KVEventsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" when enabled, else "null" (vLLM's default)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    @property
    def resolved_publisher(self) -> str:
        return self.publisher or ("zmq" if self.enable_kv_cache_events else "null")


def parse_config(data: dict | None) -> KVEventsConfig:
    """The flag's JSON object, checked; raises ValueError naming what is wrong."""
    try:
        config = msgspec.convert(data or {}, KVEventsConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"--kv-events-config: {exc}") from exc
    if config.resolved_publisher not in PUBLISHERS:
        raise ValueError(f"--kv-events-config: unknown publisher {config.publisher!r}; choose one of "
                         f"{', '.join(PUBLISHERS)}")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, name) < 1:
            raise ValueError(f"--kv-events-config: {name} must be positive")
    for endpoint in (config.endpoint, config.replay_endpoint):
        if endpoint is not None and urlsplit(endpoint).scheme not in ("tcp", "ipc", "inproc"):
            raise ValueError(f"--kv-events-config: {endpoint!r} is no ZMQ endpoint (tcp://, ipc:// or inproc://)")
    return config


def binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def bind_address(endpoint: str, host: str) -> str:
    """What to bind: `tcp://*:0` becomes an ephemeral port on `host`; everything else is vLLM's as written."""
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp" and parts.hostname in ("*", None) and parts.port == 0:
        return f"tcp://{_bracketed(host)}:0"
    return endpoint


def dial_address(bound: str, host: str) -> str:
    """Where a subscriber on another host reaches a bound endpoint: a wildcard host becomes `host`."""
    parts = urlsplit(bound)
    if parts.scheme != "tcp" or parts.hostname not in ("*", "0.0.0.0", "::", None):
        return bound
    return f"tcp://{_bracketed(host)}:{parts.port}"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class PublisherAddress(msgspec.Struct, frozen=True, kw_only=True):
    """Where a gateway subscribes to one instance: what `/v1/pdserve/info` and membership records carry."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    block_size: int | None = None  # vLLM's events name it too; a pdserve instance says it here as well
    # The shared KV store its "STORAGE" events name (URL and key namespace): every instance that says the same
    # reads those blocks too. None: such events are a tier of the instance's own.
    store: str | None = None


def parse_address(spec: str) -> PublisherAddress:
    """`tcp://host:port[,tcp://host:replay_port]`: a gateway flag's or config entry's way to name a publisher."""
    endpoint, _, replay = spec.partition(",")
    for part in (endpoint, replay):
        if part and urlsplit(part).scheme not in ("tcp", "ipc"):
            raise ValueError(f"{part!r} is no ZMQ endpoint to dial (tcp://host:port or ipc://path)")
    return PublisherAddress(endpoint=endpoint, replay_endpoint=replay or None)
