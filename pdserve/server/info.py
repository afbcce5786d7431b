"""`GET /v1/pdserve/info`: what an instance is, so a gateway can tell which protocols and partners it can take.

A gateway may front pdserve and vLLM instances at once. vLLM has no such endpoint (a 404 tells the gateway it is
not talking to pdserve); a pdserve instance says here which engine it runs, which KV connector and data planes it
has and which PD protocols it can take part in. Typed and versioned: the gateway decodes it once, on each probe.
This module imports no torch: the gateway uses it.
"""

from __future__ import annotations

import msgspec

from pdserve.kv_events.config import PublisherAddress

INFO_PATH = "/v1/pdserve/info"
INFO_VERSION = 1
ENGINE = "pdserve"

# What a pdserve KV connector speaks, whatever its data planes.
CONNECTOR_PROTOCOLS = ("pull", "push", "decode-first")


class InstanceInfo(msgspec.Struct, frozen=True, kw_only=True):
    version: int = INFO_VERSION
    engine: str = ENGINE
    engine_version: str
    role: str  # prefill, decode, both or encode
    kv_connector: str | None  # None: no KV transfer (colocated serving only)
    data_planes: list[str] = []
    protocols: list[str] = []  # the PD protocols this instance can take part in
    engine_id: str | None = None  # the KV side channel, which push-mode decode legs name
    side_channel_host: str | None = None
    side_channel_port: int | None = None
    # Foreign KV connectors this instance can load from as a decode instance (e.g. "vllm-nixl": vLLM 0.32's
    # NixlConnector prefill instances), so a gateway may pair it with them for `pull`.
    kv_sources: list[str] = []
    # Foreign decode connectors that can load this (prefill) instance's KV (e.g. "vllm-nixl": it answers vLLM
    # 0.32's NixlConnector decoders on a side channel of their own), so a gateway may pair it with them for `pull`.
    kv_sinks: list[str] = []
    # PdConnector's own KV layout ("pdserve", or "vllm-cpu" inside vLLM-CPU) and block size: an instance whose
    # kv_sources list a peer's layout regroups the peer's blocks when it reads them and its own into the peer's
    # layout when it writes them by push (same block size).
    kv_layout: str | None = None
    kv_block_size: int | None = None
    # Where this instance publishes its KV-cache events (vLLM's wire), for a gateway's prefix index: the
    # endpoints as a subscriber dials them (the advertised host, never a wildcard), the topic and block size.
    kv_events: PublisherAddress | None = None


def protocols_for(role: str, kv_connector: str | None) -> list[str]:
    """A colocated instance serves `colocated`; a KV connector adds the disaggregated protocols."""
    protocols = ["colocated"] if role == "both" else []
    if kv_connector is not None:
        protocols.extend(CONNECTOR_PROTOCOLS)
    return protocols


decode_info = msgspec.json.Decoder(InstanceInfo).decode
