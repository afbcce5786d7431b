"""The gateway's Prometheus metrics: per-leg latencies, retries, cancellations, failures, decisions, load."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pdserve.gateway.health import BreakerState
from pdserve.gateway.registry import Registry

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
            300.0)


class _LegSeconds:
    """pdserve:gateway_leg_seconds, counted without prometheus_client's Histogram, whose observe takes a lock for the
    sum and another for the bucket (four observations per request cost the gateway more than its pairing did). The
    gateway observes and is scraped on its one event-loop thread, so plain counts suffice; prometheus_client writes
    them out at scrape time as the same histogram (buckets, _count, _sum)."""

    name = "pdserve:gateway_leg_seconds"
    documentation = ("Per-leg latency: prefill (P's whole answer), kv_ready (arrival to P's answer), "
                     "decode_first_token (D's first byte after it was sent), e2e.")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = list(buckets)
        self.labels_le = [floatToGoString(b) for b in buckets] + ["+Inf"]
        # leg -> the count in each bucket (the last one +Inf's), then the sum of the observations
        self.series: dict[str, list[float]] = {}

    def observe(self, seconds_by_leg: dict[str, float]) -> None:
        """A request's four or so observations in one loop (a call each cost more than the counting)."""
        bounds, all_series = self.bounds, self.series
        for leg, seconds in seconds_by_leg.items():
            series = all_series.get(leg)
            if series is None:
                series = all_series[leg] = [0] * (len(bounds) + 1) + [0.0]
            series[bisect_left(bounds, seconds)] += 1  # the first bucket whose bound is >= seconds
            series[-1] += seconds

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=["leg"])
        for leg, series in list(self.series.items()):
            family.add_metric([leg], list(zip(self.labels_le, accumulate(series[:-1]))), series[-1])
        yield family


class _Counts:
    """A labelled counter kept as plain numbers, for the two series every request increments (its outcome, and the
    remote-or-local prefill decision): prometheus_client's Counter.inc takes a lock, checks observability and goes
    through a value object each time, for counts only the event-loop thread writes. Written out at scrape time as
    that Counter would be (`_total`, and `_created` from the series' first count)."""

    def __init__(self, name: str, documentation: str, labels: list[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labels
        self.series: dict[tuple[str, ...], list[float]] = {}  # label values -> [count, created]

    def inc(self, *values: str) -> None:
        series = self.series.get(values)
        if series is None:
            series = self.series[values] = [0.0, time.time()]
        series[0] += 1

    def collect(self):
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, (count, created) in list(self.series.items()):
            family.add_metric(list(values), count, created=created)
        yield family


class _InstanceCollector:
    def __init__(self, registry: Registry, protocol: Callable[[], str]) -> None:
        self.registry = registry
        self.protocol = protocol

    def collect(self):
        in_flight = GaugeMetricFamily("pdserve:gateway_in_flight", "Requests the gateway has on each instance.",
                                      labels=["instance", "role"])
        healthy = GaugeMetricFamily("pdserve:gateway_instance_healthy", "1 if the instance passes health checks.",
                                    labels=["instance", "role"])
        load = GaugeMetricFamily("pdserve:gateway_instance_load", "Load score used by least_loaded.",
                                 labels=["instance", "role"])
        for instance in list(self.registry.instances.values()):
            labels = [instance.url, instance.role]
            in_flight.add_metric(labels, instance.in_flight)
            healthy.add_metric(labels, 1.0 if instance.healthy else 0.0)
            load.add_metric(labels, instance.load)
        yield in_flight
        yield healthy
        yield load
        yield _info_family(self.registry)
        yield from self._breakers()

    def _breakers(self):
        state = GaugeMetricFamily("pdserve:gateway_breaker_state",
                                  "1 for the state each instance's circuit breaker is in (closed: gets traffic).",
                                  labels=["instance", "role", "state"])
        moves = CounterMetricFamily("pdserve:gateway_breaker_transitions",
                                    "Circuit breaker transitions per instance.", labels=["instance", "role", "from", "to"])
        checks = CounterMetricFamily("pdserve:gateway_health_checks",
                                     "Health checks by result: ok, failed, slow_but_serving (late while traffic "
                                     "succeeds, not held against the instance).", labels=["instance", "role", "result"])
        for instance in list(self.registry.instances.values()):
            breaker = instance.breaker
            for value in BreakerState:
                state.add_metric([instance.url, instance.role, value.value], float(breaker.state is value))
            for (old, new), count in breaker.transitions.items():
                moves.add_metric([instance.url, instance.role, old, new], count)
            for result, count in breaker.checks.items():
                checks.add_metric([instance.url, instance.role, result], count)
        yield state
        yield moves
        yield checks


def _info_family(registry: Registry) -> GaugeMetricFamily:
    """One series per identified instance, its labels saying what it is (1 while that holds)."""
    info = GaugeMetricFamily("pdserve:gateway_instance_info", "What each instance is: engine, version, KV "
                             "connector, data planes and the disaggregated protocols it takes part in.",
                             labels=["instance", "role", "engine", "version", "kv_connector", "data_planes",
                                     "protocols"])
    for instance in list(registry.instances.values()):
        caps = instance.caps
        if caps is not None:
            info.add_metric([instance.url, instance.role, caps.engine, caps.version, caps.kv_connector or "",
                             ",".join(caps.data_planes), ",".join(sorted(caps.protocols))], 1.0)
    return info


class GatewayMetrics:
    def __init__(self, registry: Registry, protocol: str) -> None:
        self.prom = CollectorRegistry(auto_describe=True)
        r = self.prom
        self.protocol = protocol
        self.requests = _Counts("pdserve:gateway_requests", "Client requests by outcome.", ["protocol", "outcome"])
        r.register(self.requests)
        self.leg_seconds = _LegSeconds(_BUCKETS)
        r.register(self.leg_seconds)
        self.retries = Counter("pdserve:gateway_retries", "Attempts retried on a fresh pair.", ["leg", "reason"],
                               registry=r)
        self.failures = Counter("pdserve:gateway_leg_failures", "Failed legs by leg and reason.", ["leg", "reason"],
                                registry=r)
        self.cancellations = Counter("pdserve:gateway_cancellations", "Requests the client abandoned, by stage.",
                                     ["stage"], registry=r)
        self.kv_releases = Counter("pdserve:gateway_kv_releases",
                                   "Explicit frees of P's held KV the instance confirmed.", ["reason"], registry=r)
        self.kv_releases_not_made = Counter(
            "pdserve:gateway_kv_releases_not_made", "Frees of held KV the gateway could not make (the instance's "
            "lease frees it): not_made is no_release_endpoint (vLLM), unreachable, status_<code>, refused, "
            "no_transfer_key, or nothing_held (the instance held nothing by that name any more).",
            ["reason", "not_made"], registry=r)
        self.decisions = _Counts("pdserve:gateway_disagg_decisions", "Remote or local prefill, with the reason.",
                                 ["decision", "reason"])
        r.register(self.decisions)
        self.encode_items = Counter("pdserve:gateway_encode_items",
                                    "Media items by outcome: encoded, cache_hit (seen before, not encoded again), "
                                    "failed (the prefill instance encodes it).", ["outcome"], registry=r)
        r.register(_InstanceCollector(registry, lambda: protocol))

        self._children: dict[tuple, object] = {}  # labelled series, looked up once (labels() is not free)

    def child(self, metric, *labels: str):
        key = (id(metric), labels)
        series = self._children.get(key)
        if series is None:
            series = self._children[key] = metric.labels(*labels)
        return series

    def decision(self, decision: str, reason: str) -> None:
        self.decisions.inc(decision, reason)

    def request_done(self, outcome: str, e2e_s: float, timings: dict[str, float]) -> None:
        self.requests.inc(self.protocol, outcome)
        self.leg_seconds.observe({"e2e": e2e_s, **timings})

    def render(self) -> bytes:
        return generate_latest(self.prom)
