"""The gateway: registry, selection policy, protocol, retries and the explicit release of held KV."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdserve.gateway.call import KV_PARAMS_REFUSED, Call, Deadlines, LegError, Stage
from pdserve.gateway.conditional import ConditionalDisagg
from pdserve.gateway.encode import EncodeFanout
from pdserve.gateway.forwarders import make_forwarder
from pdserve.gateway.health import HealthPolicy
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.pairing import Pairing
from pdserve.gateway.policies import NoInstanceError, make_policy
from pdserve.gateway.prompt_list import PromptListMerger, split_prompts
from pdserve.gateway.registry import Instance, Registry
from pdserve.gateway.release import KVReleaser
from pdserve.ids import TransferId
from pdserve.kv_events.policy import KvAware
from pdserve.kv_events.prompt import PromptTokenizer, RoutedPrompt
from pdserve.kv_events.routing import KVRouting, parse_kv_events_flags
from pdserve.membership.membership import Membership
from pdserve.membership.metrics import MembershipCollector
from pdserve.membership.record import MemberRecord, check_record
from pdserve.membership.sources import KubernetesOptions, discovery_sources
from pdserve.migration.control import Rebalancer
from pdserve.migration.splice import Splicer
from pdserve.migration.wire import SPLICE_HEADER
from pdserve.net.auth import bearer_header, resolve_api_keys
from pdserve.net.body import DEFAULT_MAX_BODY_BYTES
from pdserve.net.http_client import HttpClient
from pdserve.server.errors import error_body
from pdserve.telemetry.timeline import TimelineStore
from pdserve.telemetry.tracing import make_exporter

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode


@dataclass
class GatewayConfig:
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    both: list[str] = field(default_factory=list)
    encode: list[str] = field(default_factory=list)
    protocol: str = "pull"
    scheduling: str = "batch"
    policy: str = "least_loaded"
    retries: int = 1
    deadlines: Deadlines = field(default_factory=Deadlines)
    allow_client_kv_params: bool = False
    conditional: bool = False
    min_prompt_tokens: int = 0
    prefix_threshold: float = 0.8
    tokenizer: str | None = None  # the model's folder (chat template included) or a tokenizer.json
    kv_events: list[str] = field(default_factory=list)  # URL=tcp://host:port[,tcp://host:replay_port]
    kv_overlap_weight: float = 2.0  # kv_aware: weight of uncached prompt tokens against busy tokens
    kv_store_hit_weight: float = 0.75  # kv_aware: credit of a block held in another tier than the device cache
    kv_index_capacity: int = 1_000_000  # kv_aware: entries (instance × block) the prefix index keeps
    probe_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    breaker_failures: int = 3
    breaker_open_s: float = 3.0
    liveness_window_s: float = 10.0
    scrape_interval_s: float = 0.2
    release_timeout_s: float = 5.0
    otlp_traces_endpoint: str | None = None
    api_key: list[str] = field(default_factory=list)  # clients must send one (else VLLM_API_KEY, if set)
    instance_api_key: str | None = None  # sent to instances (default: the first api_key)
    admin_token: str | None = None  # Bearer token for the admin endpoints (else PDSERVE_ADMIN_TOKEN)
    admin_port: int | None = None  # or serve them on this loopback port
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    rebalance: bool = False  # move requests off a decode instance whose KV use or queue exceeds another's
    rebalance_margin: float = 0.2  # by this much KV use (a fraction of the cache)
    rebalance_queue_margin: float = 2.0  # or by this many waiting requests
    # A rebalancing move is discretionary, so its KV copy is paced to spare the two instances' other requests
    # (MiB/s; 0: as fast as the plane goes). A drain's moves are urgent and keep the source's own pace.
    rebalance_max_mib_per_s: float = 32.0
    discovery: str | None = None  # etcd://HOST:PORT[,...]/PREFIX, k8s[://NAMESPACE], or None: flags and /register
    discovery_relist_s: float = 30.0  # every backend lists the whole membership at least this often
    selector: str | None = None  # k8s: pods that match, their role from labels
    prefill_selector: str | None = None
    decode_selector: str | None = None
    both_selector: str | None = None
    encode_selector: str | None = None
    discovery_namespace: str | None = None
    discovery_port: int | None = None


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.forwarder = make_forwarder(config.protocol, config.scheduling)  # fails fast on a bad combination
        self.scheduling = config.scheduling
        self.deadlines = config.deadlines
        self.api_keys = resolve_api_keys(config.api_key)
        outbound = config.instance_api_key or (self.api_keys[0] if self.api_keys else None)
        # Every leg says that this gateway splices the stream of a request that moves to another instance.
        self.client = HttpClient([*bearer_header(outbound), (SPLICE_HEADER, b"1")])
        health = HealthPolicy(config.breaker_failures, config.breaker_open_s, config.probe_interval_s,
                              config.health_timeout_s, config.liveness_window_s)
        self.registry = Registry(self.client, health, config.scrape_interval_s)
        self.pairing = Pairing(self.registry, config.protocol)
        self.metrics = GatewayMetrics(self.registry, config.protocol)
        self.kv_routing = self._kv_routing(config)
        self.policies = {role: self.kv_routing.policy() if self.kv_routing is not None else make_policy(config.policy)
                         for role in ("prefill", "decode", "both", "encode")}
        self.wants_prompt = self.kv_routing is not None
        self.wants_affinity = any(policy.wants_affinity for policy in self.policies.values())
        tokenizer = self.kv_routing.tokenizer if self.kv_routing is not None else (
            PromptTokenizer(config.tokenizer) if config.tokenizer else None)
        self.conditional = ConditionalDisagg(self.metrics, config.conditional, config.min_prompt_tokens,
                                             config.prefix_threshold, tokenizer)
        self.releaser = KVReleaser(self.metrics, config.deadlines.connect_s, config.release_timeout_s)
        self.membership = Membership(discovery_sources(_static_records(config), config.discovery,
                                                       config.discovery_relist_s, _k8s_options(config)),
                                     self.registry.join, self.registry.remove)
        self.metrics.prom.register(MembershipCollector(self.membership, self.registry))
        self.encoder = EncodeFanout(self)
        self.tracing = make_exporter(config.otlp_traces_endpoint, "pdserve-gateway")
        self.timelines = TimelineStore(self.tracing)
        self.splicer = Splicer(self)
        self.rebalancer = Rebalancer(self, config.rebalance_margin, config.rebalance_queue_margin,
                                     config.rebalance_max_mib_per_s) if config.rebalance else None
        self.registry.scrape_load = self.rebalancer is not None or any(p.reads_load for p in self.policies.values())
        self.loop: asyncio.AbstractEventLoop | None = None  # the one it serves on, once started

    def _kv_routing(self, config: GatewayConfig) -> KVRouting | None:
        if config.policy != KvAware.name:
            make_policy(config.policy)  # an unknown name fails here, at startup
            return None
        if config.kv_overlap_weight < 0 or not 0 <= config.kv_store_hit_weight <= 1 or config.kv_index_capacity < 1:
            raise ValueError("kv_aware wants --kv-overlap-weight >= 0, --kv-store-hit-weight in [0, 1] and "
                             "--kv-index-capacity >= 1")
        routing = KVRouting(self.registry, config.tokenizer, config.kv_overlap_weight, config.kv_store_hit_weight,
                            config.kv_index_capacity)
        self.metrics.prom.register(routing.collector)
        return routing

    def prompt_of(self, body: dict[str, Any]) -> RoutedPrompt:
        """The prompt's token ids, for policies that route by them."""
        return self.kv_routing.prompt_of(body) if self.kv_routing is not None else RoutedPrompt(None)

    async def start(self) -> None:
        """Raises NoPairError when the pool can never serve the configured protocol."""
        self.loop = asyncio.get_running_loop()
        await self.membership.start()
        await self.registry.probe_all()
        instances = list(self.registry.instances.values())
        if instances and not any(i.healthy for i in instances):
            log.warning("none of the %d configured instances is reachable (%s); answering 503 until one passes "
                        "its health check", len(instances), ", ".join(i.url for i in instances))
        self.pairing.check_startup()
        self.registry.start()
        if self.kv_routing is not None:
            self.kv_routing.start()
        if self.rebalancer is not None:
            self.rebalancer.start()

    async def stop(self) -> None:
        if self.rebalancer is not None:
            await self.rebalancer.stop()
        if self.kv_routing is not None:
            await self.kv_routing.stop()
        await self.membership.stop()
        await self.registry.stop()
        await self.releaser.drain()
        self.client.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    @property
    def ready(self) -> bool:
        return self.registry.has_route(self.forwarder.roles) and (not self.pairing.paired or self.pairing.has_pair())

    def unready_reason(self) -> str:
        for role in self.forwarder.roles:
            if not self.registry.usable(role):
                return f"no usable {role} instances"
        return self.pairing.why_none("decode", None)

    # -- selection ------------------------------------------------------------------------------------------
    def pick(self, role: str, excluded: set[str], affinity: bytes, partner: Instance | None = None,
             prompt: RoutedPrompt | None = None) -> Instance:
        """An instance for `role`; in a disaggregated protocol, one that can exchange KV with `partner` (or, for
        the first of a pair, with some healthy instance of the other role)."""
        usable = self.pairing.candidates(role, partner)
        candidates = ([i for i in usable if i.url not in excluded] or usable) if excluded else usable
        if not candidates:
            raise NoInstanceError(self.pairing.why_none(role, partner))
        policy = self.policies[role]
        if policy.wants_prompt:
            return policy.pick(candidates, affinity, prompt)
        return policy.pick(candidates, affinity)

    # -- explicit release of held KV ------------------------------------------------------------------------
    def release_kv(self, instance: Instance, params: dict[str, Any], transfer_id: TransferId) -> None:
        """Tell P to free the KV it holds for a decode that will not happen (never wait for the lease)."""
        body = {**params, "transfer_id": params.get("transfer_id", transfer_id)}
        self.releaser.release(instance, body, "decode_not_admitted")

    def release_transfer(self, instance: Instance, transfer_id: TransferId) -> None:
        """P may have finished and held KV that nobody will read: free it by the transfer_id we minted."""
        self.releaser.release(instance, {"transfer_id": transfer_id}, "prefill_abandoned")

    # -- one client request ---------------------------------------------------------------------------------
    async def handle(self, path: str, body: dict[str, Any], request_id: str, send: Any,
                     traceparent: str | None = None) -> None:
        parts = split_prompts(body) if self.forwarder.single_prompt else None
        if parts is not None:
            n = body.get("n") if isinstance(body.get("n"), int) and body["n"] > 0 else 1
            merger = PromptListMerger(request_id, send, n, stream=bool(body.get("stream")))
            await merger.run(lambda part, rid, part_send: self.handle(path, part, rid, part_send, traceparent), parts)
            return
        timeline = self.timelines.start(request_id, "gateway", traceparent=traceparent)
        call = Call(self, path, body, request_id, send, stream=bool(body.get("stream")), timeline=timeline)
        outcome = "error"
        try:
            await self.encoder.prepare(call)
            outcome = await self._attempts(call)
        except asyncio.CancelledError:
            self.metrics.cancellations.labels(call.stage.value).inc()
            self._abandon(call)
            outcome = "cancelled"
            raise
        finally:
            call.end_attempt()
            self.metrics.request_done(outcome, time.monotonic() - call.started, call.timings)
            timeline.finish(outcome=outcome)

    async def _attempts(self, call: Call) -> str:
        retries_left = self.config.retries
        while True:
            call.new_attempt()
            try:
                await self.forwarder.run(call)
                return "ok"
            except NoInstanceError as exc:
                await self._fail(call, 503, error_body(503, str(exc)))
                return "no_instance"
            except LegError as exc:
                self.metrics.failures.labels(exc.leg, exc.reason).inc()
                if exc.reason == KV_PARAMS_REFUSED and not call.without_kv and not call.first_byte_sent:
                    self._without_kv(call, exc)
                    continue
                self._abandon(call)
                if exc.instance is not None:
                    call.excluded.add(exc.instance.url)
                if exc.retryable and not call.first_byte_sent and retries_left > 0:
                    retries_left -= 1
                    self.metrics.retries.labels(exc.leg, exc.reason).inc()
                    log.info("request %s: %s; retrying on another pair", call.request_id, exc)
                    continue
                await self._fail(call, exc.status, _body_of(exc))
                return f"{exc.leg}_failed"

    def _without_kv(self, call: Call, exc: LegError) -> None:
        """An instance refused the KV parameters the gateway wrote (a mismatch between instances, or between the
        gateway and one): the next attempt sends D the client's own body, D computes the prompt, and the client
        gets its answer rather than an error about parameters it never sent. What P may hold is freed now."""
        log.warning("request %s: %s; D computes the prompt itself", call.request_id, exc)
        prefill = call.picks.get("prefill")
        if prefill is not None and call.held is None and call.stage is not Stage.CREATED:
            self.release_transfer(prefill, call.transfer_id)  # pull holds call.held, freed by end_attempt
        call.end_attempt()
        call.without_kv = True
        self.metrics.decision("local_prefill", f"{exc.leg}_refused_kv_params")

    def _abandon(self, call: Call) -> None:
        """End this attempt's legs; if P was prefilling, make sure nothing it may have held stays held."""
        prefill = call.picks.get("prefill")
        if call.stage == Stage.PREFILL_SENT and prefill is not None:
            self.release_transfer(prefill, call.transfer_id)
        call.end_attempt()

    async def _fail(self, call: Call, status: int, body: bytes | dict) -> None:
        payload = body if isinstance(body, bytes) else _encode(body)
        if call.first_byte_sent:
            # Too late for a status code: an error event the client can parse, then the end of the stream.
            if not payload.startswith(b'{"error"'):
                payload = _encode(error_body(status, payload.decode(errors="replace")))
            await call.write(b"data: " + payload + b"\n\ndata: [DONE]\n\n")
            await call.finish()
            return
        await call.respond_json(status, payload)


def _static_records(config: GatewayConfig) -> list[MemberRecord]:
    """The configured instances, each with where it publishes KV events when `--kv-events` names it."""
    records = [check_record(MemberRecord(url=url, role=role, source="static"))
               for role in ("prefill", "decode", "both", "encode") for url in getattr(config, role)]
    publishers = parse_kv_events_flags(config.kv_events)
    unknown = set(publishers) - {record.url for record in records}
    if unknown:
        raise ValueError(f"--kv-events names {', '.join(sorted(unknown))}, which is no configured instance")
    return [msgspec.structs.replace(record, kv_events=publishers[record.url]) if record.url in publishers else record
            for record in records]


def _k8s_options(config: GatewayConfig) -> KubernetesOptions:
    roles = {role: getattr(config, f"{role}_selector") for role in ("prefill", "decode", "both", "encode")}
    return KubernetesOptions(config.selector, {r: s for r, s in roles.items() if s}, config.discovery_namespace,
                             config.discovery_port)


def _body_of(exc: LegError) -> bytes | dict:
    if exc.body and exc.body.startswith(b"{"):
        return exc.body  # the instance's own OpenAI error (e.g. a 400 about the prompt) is the clearest answer
    return error_body(exc.status, str(exc))
