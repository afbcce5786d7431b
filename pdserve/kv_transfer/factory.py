"""Building an instance's KV connectors from its config: the registry of connectors lives here.

A bundle ties together what one instance needs for transfers: the connector's scheduler and worker halves, the
data planes (which also own the KV pool's memory) and the transfer agent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import torch

from pdserve.config import EngineConfig
from pdserve.ids import new_engine_id
from pdserve.kv_store.chain import ChainScheduler, ChainWorker
from pdserve.kv_store.factory import build_store, chain_scheduler, chain_worker, namespace_for, store_entry
from pdserve.kv_store.metrics import STORE_METRICS, store_metric_values
from pdserve.kv_store.tier import KVStoreTier
from pdserve.kv_transfer.agent import AgentConfig, TransferAgent
from pdserve.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker
from pdserve.kv_transfer.data_plane import DATA_PLANES, DataPlane, make_data_plane
from pdserve.kv_transfer.decode_first import DecodeFirstClient
from pdserve.kv_transfer.faults import FaultConfig, resolve_fault_config
from pdserve.kv_transfer.layouts import VLLM_CPU, pdserve_layout
from pdserve.kv_transfer.messages import PROTOCOL_VERSION
from pdserve.kv_transfer.metrics import TRANSFER_METRICS, transfer_metric_values
from pdserve.kv_transfer.params import (VLLM_NIXL, DecodeFirst, ForeignPrefill, KVParamsError, KVTransferParams,
                                        RemoteDecode, RemotePrefill, parse_kv_params, parse_release)
from pdserve.kv_transfer.pd_connector import PdConnectorScheduler, PdConnectorWorker, ProducerIdentity
from pdserve.kv_transfer.peer_policy import PeerNotAllowed, PeerPolicy
from pdserve.kv_transfer.vllm_nixl.consumer import VllmNixlConsumer
from pdserve.kv_transfer.vllm_nixl.mirror_plan import MirrorPlan
from pdserve.kv_transfer.vllm_nixl.producer import MirrorConfig, VllmNixlProducer
from pdserve.kv_transfer.vllm_nixl.wire import DEFAULT_RELEASE, SUPPORTED_SERIES, ModelShape
from pdserve.models.config import ModelSpec
from pdserve.models.loader import checkpoint_files
from pdserve.utils import cdiv, pace_bytes_per_s

log = logging.getLogger(__name__)

KV_LAYOUT = "blocks,layers,kv,heads,block_size,head_dim"
DEFAULT_CONNECTOR = "PdConnector"


class KVParamsRejected(ValueError):
    """Raised for kv_transfer_params the server must refuse with a 400."""


@dataclass
class ConnectorBundle:
    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker
    agent: TransferAgent
    planes: dict[str, DataPlane]
    engine_id: str
    max_blocks: int
    pool_owner: str
    decode_first: DecodeFirstClient = field(default_factory=DecodeFirstClient)
    fault_api: bool = False  # whether POST /v1/kv/faults may switch fault injection at run time
    load_failure_policy: str = "recompute"
    loads_vllm: bool = False  # whether vLLM NixlConnector producers' KV is loaded (else it is foreign)
    store: KVStoreTier | None = None  # the shared KV store tier, whose halves sit beside PdConnector's
    foreign_params: int = 0  # requests whose remote-prefill parameters were another engine's
    _foreign_seen: set[str] = field(default_factory=set)  # engines already logged

    def kv_allocator(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        kv = self.planes[self.pool_owner].allocate(shape, dtype)
        for name, plane in self.planes.items():
            if name != self.pool_owner:
                plane.attach(kv)
        return kv

    @property
    def pd_scheduler(self) -> KVConnectorScheduler:
        """PdConnector's own scheduler half (the engine's is it, or it beside the store tier's)."""
        return self.scheduler.first if isinstance(self.scheduler, ChainScheduler) else self.scheduler

    @property
    def pd_worker(self) -> KVConnectorWorker:
        return self.worker.first if isinstance(self.worker, ChainWorker) else self.worker

    async def start(self, async_engine: Any, advertised_host: str) -> None:
        self.agent.on_event = async_engine.wake
        if self.store is not None:
            self.store.on_event = async_engine.wake
        self.agent.start()
        scheduler = self.pd_scheduler
        if isinstance(scheduler, PdConnectorScheduler):
            scheduler.identity = ProducerIdentity(self.engine_id, self.agent.config.host, self.agent.port)
            producer = self.agent.vllm_producer
            if producer is not None:
                scheduler.vllm_identity = ProducerIdentity(self.engine_id, producer.config.host, producer.port)

    async def stop(self) -> None:
        self.decode_first.close()
        self.agent.stop()
        if self.store is not None:
            self.store.close()

    def parse_request_params(self, params: Any) -> KVTransferParams | None:
        """A body's kv_transfer_params, parsed once where the server reads the request; below, only the types."""
        try:
            return parse_kv_params(params, self.max_blocks)
        except KVParamsError as exc:
            raise KVParamsRejected(str(exc)) from exc

    def check_request_params(self, parsed: KVTransferParams, num_prompts: int, n: int) -> None:
        """One transfer is one prompt's KV. A decode request may sample it n times (the samples share the blocks);
        a prefill leg prefills once, so it takes n = 1 (routers send P one token, whatever the client asked)."""
        if num_prompts > 1:
            self.reject(parsed, "a list of prompts")
            raise KVParamsRejected("kv_transfer_params belong to a single prompt: send one request per prompt")
        if n > 1 and isinstance(parsed, RemoteDecode):
            raise KVParamsRejected("a prefill request (do_remote_decode) prefills once: it takes n = 1")

    async def prepare_request_params(self, parsed: KVTransferParams, prompt_token_ids: list[int]
                                     ) -> KVTransferParams | None:
        """Decode-first: ask the named prefill instance to prefill (and hold) this prompt, then pull from it.

        Every peer the params name is checked against allowed_peers here, before anything is dialled or
        allocated: a refused one is a 400, never a connection attempt (or its retries) to wherever it points.
        Another engine's parameters: prefill here at once (`recompute`) or refuse the request (`fail`).
        """
        if isinstance(parsed, ForeignPrefill):
            if not (self.loads_vllm and parsed.prefill is not None):
                return self._foreign(parsed)
            parsed = replace(parsed.prefill, mode=VLLM_NIXL)  # vLLM's KV, loaded with vLLM's own protocol
        if isinstance(parsed, DecodeFirst):
            await self._check_peer(urlsplit(parsed.prefill_url).hostname or "", "remote_prefill_url")
            parsed = await self.decode_first.prefill(parsed, prompt_token_ids, self.max_blocks)
        if isinstance(parsed, RemotePrefill):
            await self._check_peer(parsed.host, "remote_host")
        return parsed

    async def _check_peer(self, host: str, key: str) -> None:
        try:
            await self.agent.config.peers.check(host)
        except PeerNotAllowed as exc:
            raise KVParamsRejected(f"kv_transfer_params.{key}: {exc}") from exc

    def _foreign(self, parsed: ForeignPrefill) -> None:
        self.foreign_params += 1
        engine = parsed.engine_id or "an unnamed engine"
        if self.load_failure_policy == "fail":
            raise KVParamsRejected(f"kv_transfer_params name KV held by {engine}, which is not a pdserve instance "
                                   f"({parsed.why}); this decode instance cannot load it (kv_load_failure_policy "
                                   "is fail)")
        if engine not in self._foreign_seen:
            self._foreign_seen.add(engine)
            log.warning("kv_transfer_params from %s are not pdserve's (%s): prefilling locally; that engine frees "
                        "what it holds on its own lease", engine, parsed.why)
        return None

    def release_local(self, body: Any) -> bool:
        """`POST /v1/kv/release` on a producer: free held KV by (remote_request_id, token) or by transfer_id."""
        try:
            release = parse_release(body)
        except KVParamsError as exc:
            raise KVParamsRejected(str(exc)) from exc
        return self.agent.release_local(release.key, release.token, release.transfer_id)

    def held_for_others(self) -> int:
        """Transfers whose KV this producer still holds for a consumer."""
        return self.agent.num_leases()

    def release_all_held(self) -> int:
        return self.agent.pull_producer.release_all()

    def set_faults(self, raw: dict[str, Any]) -> dict[str, Any]:
        if not self.fault_api:
            raise KVParamsRejected("fault injection at run time is off (kv_connector_extra_config.fault_injection_api)")
        self.agent.set_faults(FaultConfig.from_dict(raw))
        return {"faults": msgspec.to_builtins(self.agent.faults.config), "injected": self.agent.faults.injected}

    def reject(self, parsed: KVTransferParams, reason: str) -> None:
        """A request with remote KV was refused before admission: tell P to free its blocks now."""
        if isinstance(parsed, ForeignPrefill) and self.loads_vllm and parsed.prefill is not None:
            held = parsed.prefill  # vLLM's: its own notification frees it (a pdserve message would break its listener)
            self.agent.pull_consumer.send_vllm_release(held.host, held.port, held.engine_id, held.remote_key)
        elif isinstance(parsed, RemotePrefill) and parsed.remote_key is not None:
            self.agent.send_release(parsed.host, parsed.port, parsed.remote_key, parsed.token or "",
                                    f"rejected before admission: {reason}")

    def metrics(self) -> dict[str, float]:
        values = transfer_metric_values(self.agent, self.pd_worker)
        if self.store is not None:
            values.update(store_metric_values(self.store.stats))
        kinds = {m.name: m.kind for m in TRANSFER_METRICS + STORE_METRICS}
        return {
            **{f"{kinds[name]} {name}": value for name, value in values.items()},
            "counter pdserve:decode_first_prefills": self.decode_first.prefills,
            "counter pdserve:decode_first_fallbacks": self.decode_first.fallbacks,
            "counter pdserve:kv_foreign_params": self.foreign_params,
            "gauge pdserve:kv_vllm_mirror_blocks_held": self._mirror_blocks_held(),
            "counter pdserve:kv_vllm_side_channel_refusals": self.agent.vllm_producer.refused
            if self.agent.vllm_producer is not None else 0,
        }

    def _mirror_blocks_held(self) -> int:
        scheduler = self.pd_scheduler
        mirror = scheduler.mirror if isinstance(scheduler, PdConnectorScheduler) else None
        return mirror.num_held() if mirror is not None else 0

    def kv_sources(self) -> list[str]:
        """Foreign prefill instances this one loads from as a decode instance: vLLM NixlConnector's (when enabled),
        and PdConnector's inside vLLM-CPU, whose blocks it regroups (`layouts.py`)."""
        return (["vllm-nixl"] if self.loads_vllm else []) + [VLLM_CPU]

    def ready_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"engine_id": self.engine_id, "side_channel_port": self.agent.port}
        for name, plane in self.planes.items():
            fields[f"{name}_data_plane"] = plane.local_info()
        return fields


def compatibility_hash(config: EngineConfig, model: ModelSpec, weights: str) -> str:
    """Instances may exchange KV only if this matches: model (`weights`: its `weight_fingerprint`), dtype, KV
    layout, block size, protocol version."""
    text = model.text
    identity = {
        "protocol": PROTOCOL_VERSION, "layout": KV_LAYOUT, "block_size": config.block_size,
        "dtype": str(model.dtype), "layers": text.num_layers, "kv_heads": text.num_kv_heads, "head_dim": text.head_dim,
        "hidden": text.hidden_size, "vocab": text.vocab_size, "weights": weights,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def weight_fingerprint(model_dir: Path) -> str:
    """Cheap but telling: each shard's header plus a few samples of its bytes (copies of a model agree)."""
    h = hashlib.sha256()
    for path in checkpoint_files(model_dir):
        size = path.stat().st_size
        with path.open("rb") as f:
            h.update(f.read(1 << 16))
            for i in range(1, 16):
                f.seek(size * i // 16)
                h.update(f.read(4096))
    return h.hexdigest()


Builder = Callable[[EngineConfig, ModelSpec], ConnectorBundle]


EXTRA_CONFIG_KEYS = frozenset({
    "data_plane", "side_channel_host", "side_channel_port", "kv_lease_duration", "kv_load_timeout", "message_timeout",
    "handshake_timeout", "push_registration_timeout", "capture_messages", "fault_injection", "fault_injection_api",
    "allowed_peers", "vllm_nixl", "vllm_model", "vllm_nixl_port", "vllm_block_size", "vllm_mirror_blocks",
    "vllm_version", "push_quarantine", "kv_store", "migration_max_mib_per_s"})


def extra_config(kv_cfg: dict[str, Any]) -> dict[str, Any]:
    """`kv_connector_extra_config`, refused whole if a key is unknown (a misspelt one would be ignored)."""
    extra = dict(kv_cfg.get("kv_connector_extra_config") or {})
    unknown = set(extra) - EXTRA_CONFIG_KEYS
    if unknown:
        raise ValueError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(EXTRA_CONFIG_KEYS)}")
    return extra


def side_channel_address(kv_cfg: dict[str, Any], extra: dict[str, Any]) -> tuple[str, int]:
    return (str(extra.get("side_channel_host", kv_cfg.get("kv_ip", "127.0.0.1"))),
            int(extra.get("side_channel_port", kv_cfg.get("kv_port", 0))))


def agent_config(kv_cfg: dict[str, Any], extra: dict[str, Any], engine_id: str, compat_hash: str,
                 planes: dict[str, DataPlane]) -> AgentConfig:
    """The transfer agent's settings from a kv_transfer_config (pdserve's or vLLM's, which share the keys)."""
    host, port = side_channel_address(kv_cfg, extra)
    return AgentConfig(
        engine_id=engine_id, compat_hash=compat_hash, host=host, port=port,
        lease_s=float(extra.get("kv_lease_duration", 30.0)),
        load_timeout_s=float(extra.get("kv_load_timeout", 60.0)),
        message_timeout_s=float(extra.get("message_timeout", 10.0)),
        handshake_timeout_s=float(extra.get("handshake_timeout", 5.0)),
        push_timeout_s=float(extra.get("push_registration_timeout", 60.0)),
        push_quarantine=bool(extra.get("push_quarantine", False)),
        # 0, the default: live migrations copy unpaced.
        migration_bytes_per_s=pace_bytes_per_s(extra.get("migration_max_mib_per_s", 0), "migration_max_mib_per_s"),
        capture_path=extra.get("capture_messages") or os.environ.get("PDSERVE_CAPTURE_MESSAGES"),
        preferred_plane=str(extra.get("data_plane", "auto")), planes=planes, faults=resolve_fault_config(extra),
        peers=PeerPolicy.from_config(extra.get("allowed_peers")))


def connector_halves(agent: TransferAgent, block_size: int, policy: str, mirror: MirrorPlan | None = None
                     ) -> tuple[PdConnectorScheduler, PdConnectorWorker]:
    """PdConnector's scheduler and worker halves, the same for a pdserve instance and inside vLLM."""
    config = agent.config
    scheduler = PdConnectorScheduler(block_size, load_timeout_s=config.load_timeout_s, load_failure_policy=policy,
                                     mirror=mirror)
    worker = PdConnectorWorker(agent, block_size, push_timeout_s=config.push_timeout_s,
                               unregistered_timeout_s=config.lease_s, load_failure_policy=policy)
    return scheduler, worker


def build_pd_connector(config: EngineConfig, model: ModelSpec) -> ConnectorBundle:
    kv_cfg = config.kv_transfer_config
    extra = extra_config(kv_cfg)
    host, _ = side_channel_address(kv_cfg, extra)
    engine_id = str(kv_cfg.get("engine_id") or new_engine_id())
    preferred = str(extra.get("data_plane", "auto"))
    # auto (and shm, which falls back to tcp) serves every installed plane; the first one owns the pool.
    auto = [name for name in ("shm", "nixl", "tcp") if name in DATA_PLANES]
    plane_names = auto if preferred in ("auto", "shm") else [preferred]
    planes = {name: make_data_plane(name, host) for name in plane_names}
    weights = weight_fingerprint(model.path)  # read once: the hash and the layout identity both name it
    settings = agent_config(kv_cfg, extra, engine_id, compatibility_hash(config, model, weights), planes)
    text = model.text
    settings.layout = pdserve_layout(config.block_size, text.num_layers, text.num_kv_heads, text.head_dim, model.dtype,
                                     weights)
    agent = TransferAgent(settings)
    max_blocks = cdiv(model.max_model_len, config.block_size)
    policy = str(kv_cfg.get("kv_load_failure_policy", "recompute"))
    mirror = vllm_mirror(extra, host, engine_id, model, agent)
    plan = MirrorPlan(mirror.num_blocks, mirror.block_size, config.block_size) if mirror is not None else None
    scheduler, worker = connector_halves(agent, config.block_size, policy, plan)
    loads_vllm = bool(extra.get("vllm_nixl"))
    if loads_vllm:
        agent.pull_consumer.vllm = VllmNixlConsumer(agent.rt, vllm_model_shape(model, extra.get("vllm_model")),
                                                    model.max_model_len)
    store = build_store(store_entry(kv_cfg, extra), namespace_for(
        weights, model.dtype, config.block_size, text.num_layers, text.num_kv_heads, text.head_dim))
    if store is not None:
        scheduler, worker = chain_scheduler(scheduler, store), chain_worker(worker, store)
    return ConnectorBundle(scheduler=scheduler, worker=worker, agent=agent, planes=planes,
                           engine_id=engine_id, max_blocks=max_blocks, pool_owner=plane_names[0],
                           fault_api=bool(extra.get("fault_injection_api", os.environ.get("PDSERVE_FAULTS_API"))),
                           load_failure_policy=policy, loads_vllm=loads_vllm, store=store)


def vllm_mirror(extra: dict[str, Any], host: str, engine_id: str, model: ModelSpec, agent: TransferAgent
                ) -> MirrorConfig | None:
    """With `vllm_nixl_port` set, vLLM NixlConnector decoders may read this producer's KV: vLLM's side channel
    there, and a mirror pool of `vllm_mirror_blocks` blocks of `vllm_block_size` tokens (vLLM-CPU's default 128;
    the decoders' own block size) in vLLM-CPU's layout."""
    if "vllm_nixl_port" not in extra:
        return None
    block_size = int(extra.get("vllm_block_size", 128))
    if block_size <= 0 or block_size % 32:
        raise ValueError("vllm_block_size must be a positive multiple of 32, as vLLM-CPU's block sizes are")
    num_blocks = int(extra.get("vllm_mirror_blocks", 8 * cdiv(model.max_model_len, block_size)))
    release = str(extra.get("vllm_version", DEFAULT_RELEASE))
    if not release.startswith(SUPPORTED_SERIES + "."):
        raise ValueError(f"vllm_version must be a vLLM {SUPPORTED_SERIES}.x release (its handshake is the one spoken)")
    config = MirrorConfig(host=host, port=int(extra["vllm_nixl_port"]), block_size=block_size,
                          num_blocks=num_blocks, release=release)
    agent.vllm_producer = VllmNixlProducer(engine_id, vllm_model_shape(model, extra.get("vllm_model")), config,
                                           agent.pull_producer)
    return config


def vllm_model_shape(model: ModelSpec, served_as: str | None) -> ModelShape:
    """This model as vLLM's compatibility hash names it: `served_as` is the model argument vLLM was started with
    (its hash includes it verbatim); by default, this instance's own model folder."""
    text = model.text
    return ModelShape(model=str(served_as or model.path), dtype=str(model.dtype), num_kv_heads=text.num_kv_heads,
                      head_size=text.head_dim, num_layers=text.num_layers)


KV_CONNECTORS: dict[str, Builder] = {"PdConnector": build_pd_connector}


def build_connectors(config: EngineConfig, model: ModelSpec) -> ConnectorBundle | None:
    """The connector bundle for this instance, or None for plain colocated serving."""
    if not config.kv_transfer_config and config.role == "both":
        return None
    name = config.kv_transfer_config.get("kv_connector") or DEFAULT_CONNECTOR
    builder = KV_CONNECTORS.get(name)
    if builder is None:
        raise ValueError(f"unknown kv_connector {name!r}; available: {', '.join(sorted(KV_CONNECTORS))}")
    return builder(config, model)
