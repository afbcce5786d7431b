"""The gateway's view of its instances: role, kind, health, load (scraped) and in-flight requests (its own count).

Instances can be added and removed at run time. Health is each instance's circuit breaker (health.py), fed by
periodic checks of /health and by the requests themselves; load comes from /metrics scraped at a short
interval, plus the gateway's own in-flight accounting, which is released the moment a leg ends. Nothing is scraped
where nothing reads the scraped load (round_robin, kv_aware without the rebalancer): four instances polled five
times a second cost an idle gateway about 1 % of a core, and each instance as much again to render its metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pdserve.gateway.capabilities import Capabilities, learn
from pdserve.gateway.health import Breaker, HealthPolicy
from pdserve.membership.identity import DRAINING_HEADER, served_model
from pdserve.membership.record import ROLES, MemberRecord, RecordError, normalise_url
from pdserve.net.http_client import HttpClient, HttpPool, UpstreamError, UpstreamTimeout

log = logging.getLogger(__name__)
_DRAIN_HEADERS = frozenset({DRAINING_HEADER})  # the one upstream header the gateway reads: on /health probes
# What an instance is cannot change while one kept-alive connection still reaches it (a restart breaks it); asked
# again on a new connection, and at least this often besides (a proxy in front may keep a connection across one).
_RELEARN_S = 30.0

_LOAD_METRICS = {b"vllm:num_requests_running": "running", b"vllm:num_requests_waiting": "waiting",
                 b"vllm:kv_cache_usage_perc": "kv_usage"}


@dataclass(eq=False)
class Instance:
    url: str
    role: str
    pool: HttpPool
    probe_pool: HttpPool  # health checks: connections of their own, the only ones that read a header
    breaker: Breaker = field(default_factory=Breaker)
    in_flight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    caps: Capabilities | None = None  # what it is; learned on each probe, None until it first answered
    record: MemberRecord | None = None  # the membership record it was built from (set by Registry.join)
    draining: bool = False  # its /health says it is draining: no new work, whatever its breaker says
    model: str | None = None  # the model it answered it serves, when its record names one to check
    learned_at: float = float("-inf")  # when `caps` was last asked for
    # kv_aware's load, the gateway's own count over the legs in flight here: prompt tokens the instance did not hold
    # and has not prefilled yet (until a leg's first token), and the KV those legs keep (with their output).
    pending_tokens: int = 0
    active_tokens: int = 0

    @property
    def healthy(self) -> bool:
        return self.breaker.closed and not self.draining

    @property
    def load(self) -> float:
        """Requests the instance is busy with: the freshest of its own report and our count, plus queue depth."""
        return max(self.running, self.in_flight) + self.waiting + self.kv_usage

    def serves(self, role: str) -> bool:
        """A colocated instance can stand in for a prefill or decode one; encoding needs an encode instance."""
        return self.role == role or (self.role == "both" and role != "encode")


class Registry:
    def __init__(self, client: HttpClient, health: HealthPolicy | None = None,
                 scrape_interval_s: float = 0.2) -> None:
        self.client = client
        self.instances: dict[str, Instance] = {}
        self.health = health or HealthPolicy()
        self.scrape_interval_s = scrape_interval_s
        # Whether anything reads the scraped load (a policy, the rebalancer); the gateway says so before start().
        self.scrape_load = True
        self._tasks: list[asyncio.Task] = []
        self._probes: set[asyncio.Task] = set()  # first checks of members that joined while running
        self.epoch = 0  # counts the changes `changed` is told of

    # -- membership ---------------------------------------------------------------------------------------
    def add(self, url: str, role: str) -> Instance:
        """A member by URL and role alone (flags, config file)."""
        return self.join(MemberRecord(url=url, role=role, source="static"))

    def join(self, record: MemberRecord) -> Instance:
        """Add the instance a membership record describes, or update the one at its URL."""
        if record.role not in ROLES:
            raise ValueError(f"unknown role {record.role!r}; choose one of {', '.join(ROLES)}")
        try:
            url = normalise_url(record.url)
        except RecordError as exc:
            raise ValueError(str(exc)) from None
        existing = self.instances.get(url)
        if existing is not None:
            if existing.record is not None and existing.record.model != record.model:
                existing.model = None  # check the instance against the model its new record names
            existing.role, existing.record = record.role, record
            self.changed()
            return existing
        parts = urlsplit(url)
        instance = Instance(url=url, role=record.role, pool=self.client.pool(parts.hostname, parts.port),
                            probe_pool=self.client.pool(parts.hostname, parts.port, _DRAIN_HEADERS),
                            breaker=Breaker(self.health, url, on_move=self.changed), record=record)
        self.instances = {**self.instances, url: instance}
        self.changed()
        if self._tasks:  # running: check it now, so that it can take traffic at once, not at the next tick
            probe = asyncio.create_task(self._probe(instance))
            self._probes.add(probe)
            probe.add_done_callback(self._probes.discard)
        return instance

    def remove(self, url: str) -> bool:
        url = url.rstrip("/")
        if url not in self.instances:
            return False
        self.instances = {k: v for k, v in self.instances.items() if k != url}
        self.changed()
        return True

    def usable(self, role: str) -> list[Instance]:
        return [i for i in self.instances.values() if i.healthy and i.serves(role)]

    def changed(self) -> None:
        """Something `usable` and pairing read changed: an instance came or went, or one's role, breaker state,
        draining or capabilities. What was worked out from them before is stale (`epoch`, a cache key)."""
        self.epoch += 1

    def has_route(self, needs: tuple[str, ...]) -> bool:
        return all(self.usable(role) for role in needs)

    # -- passive health -----------------------------------------------------------------------------------
    @staticmethod
    def report_failure(instance: Instance, exc: Exception) -> None:
        """A request could not reach the instance, broke mid-answer or timed out (never: it answered an error)."""
        instance.breaker.failure(f"request failed: {exc}")

    # -- background probes --------------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._probe_loop())]
        if self.scrape_load:
            self._tasks.append(asyncio.create_task(self._scrape_loop()))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._probes]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def probe_all(self) -> None:
        """Check every instance now, whatever its breaker says (startup, registration)."""
        await asyncio.gather(*(self._probe(i) for i in list(self.instances.values())))

    async def _probe_loop(self) -> None:
        tick = min(self.health.probe_interval_s, self.health.open_s)
        while True:
            now = time.monotonic()
            await asyncio.gather(*(self._probe(i) for i in list(self.instances.values()) if i.breaker.probe_due(now)))
            await asyncio.sleep(tick)

    async def _probe(self, instance: Instance) -> None:
        timeout = self.health.probe_timeout_s
        slow, detail = False, ""
        try:
            async with asyncio.timeout(timeout):
                detail = await self._check(instance)
        except (TimeoutError, UpstreamTimeout):
            slow, detail = True, f"no answer within {timeout:g} s"
        except (UpstreamError, OSError) as exc:
            detail = str(exc)
        instance.breaker.probe_result(detail == "", slow, detail)

    async def _check(self, instance: Instance) -> str:
        """One health check: "" if the instance is fit for traffic, else why not. A draining instance is fit
        (it finishes what it runs) but takes no new work: that is membership, not health."""
        response = await instance.probe_pool.request("GET", "/health", connect_timeout=self.health.probe_timeout_s)
        await response.read()
        draining = response.header(DRAINING_HEADER) is not None
        if draining != instance.draining:
            log.info("instance %s %s", instance.url, "is draining: no new work" if draining else "no longer drains")
            instance.draining = draining
            self.changed()
        if response.status != 200 and not draining:
            return f"/health answered {response.status}"
        now = time.monotonic()
        if (instance.caps is None or not response.reused_connection or now - instance.learned_at >= _RELEARN_S) \
                and not await self._learn(instance, now):
            return "it did not say what it is (info endpoint or /version unreadable)"
        return await self._check_model(instance)

    async def _check_model(self, instance: Instance) -> str:
        """An instance whose record names a model must answer as that model (asked until it once did, and again
        whenever its breaker is not closed: a restart may bring another model to the same address)."""
        expected = instance.record.model if instance.record is not None else None
        if expected is None or (instance.model == expected and instance.breaker.closed):
            return ""
        instance.model = await served_model(instance.probe_pool)
        if instance.model != expected:
            return f"it serves model {instance.model!r}, but registered as {expected!r}"
        return ""

    async def _learn(self, instance: Instance, now: float) -> bool:
        """What the instance is, asked again whenever a restart may have put another engine at its address."""
        caps = await learn(instance.probe_pool, instance.caps)
        if caps is None:
            return False
        instance.learned_at = now
        if caps != instance.caps:
            log.info("%s instance %s is %s", instance.role, instance.url, caps.describe())
            instance.caps = caps
            self.changed()
        return True

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._scrape(i) for i in list(self.instances.values())
                                   if i.healthy and self._contested(i)))
            await asyncio.sleep(self.scrape_interval_s)

    def _contested(self, instance: Instance) -> bool:
        """Load only decides between instances that can take the same leg. An instance alone in its roles is not
        scraped: vLLM's /metrics is ~60 KB, and at a few requests a second polling it five times a second would
        cost the gateway more CPU than the requests do."""
        roles = [role for role in ("prefill", "decode", "encode") if instance.serves(role)]
        return any(other is not instance and other.serves(role)
                   for other in list(self.instances.values()) for role in roles)

    async def _scrape(self, instance: Instance) -> None:
        try:
            response = await instance.pool.request("GET", "/metrics", connect_timeout=1.0, header_timeout=2.0)
            text = await response.read(timeout=2.0)
        except (UpstreamError, UpstreamTimeout, OSError):
            return
        values = parse_load_metrics(text)
        instance.running = values.get("running", instance.running)
        instance.waiting = values.get("waiting", instance.waiting)
        instance.kv_usage = values.get("kv_usage", instance.kv_usage)


def parse_load_metrics(text: bytes) -> dict[str, float]:
    """Sum the few load gauges a router needs from Prometheus text (all label sets)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == 35:  # '#'
            continue
        name_end = line.find(b"{")
        if name_end < 0:
            name_end = line.find(b" ")
        key = _LOAD_METRICS.get(line[:name_end])
        if key is None:
            continue
        try:
            out[key] = out.get(key, 0.0) + float(line.rsplit(b" ", 1)[1])
        except ValueError:
            continue
    return out
