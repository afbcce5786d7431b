"""Prometheus metrics of one instance, with vLLM's names where vLLM has the metric.

Each server owns its registry (nothing module-level), so two instances can live in one process. Gauges and
engine-side counters are read from the engine at scrape time; latency histograms are observed when a request
finishes on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.engine.llm_engine import EngineStats
from pdserve.engine.output_processor import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)


class _EngineCollector:
    """Reads engine state when Prometheus scrapes; the numbers are plain ints, safe to read across threads."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats], extra: Callable[[], dict[str, float]]) -> None:
        self.model_name = model_name
        self.stats = stats
        self.extra = extra

    def collect(self):
        s = self.stats()
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting, including those waiting for remote KV.",
                    s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1.", s.kv_cache_usage)
        yield gauge("pdserve:kv_blocks_in_use", "KV blocks held by requests (or by connectors for them).",
                    s.blocks_used)
        yield gauge("pdserve:kv_blocks_total", "KV blocks in the pool.", s.blocks_total)
        yield gauge("pdserve:num_requests_held", "Finished requests whose blocks a connector still holds.",
                    s.num_held)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hits)
        yield counter("vllm:num_preemptions", "Requests preempted (to be recomputed).", s.num_preemptions)
        yield counter("pdserve:prompt_tokens_computed", "Prompt tokens computed here (not prefix hits, not transferred).",
                      s.prompt_tokens_computed)
        yield gauge("pdserve:encoder_cache_entries", "Encoder outputs kept (shared by mm_hash).", s.encoder_entries)
        yield gauge("pdserve:encoder_cache_entries_held", "Encoder outputs some live request still needs.",
                    s.encoder_entries_held)
        yield counter("pdserve:encoder_cache_hits", "Media items whose encoder output was already kept.", s.encoder_hits)
        yield counter("pdserve:encoder_cache_misses", "Media items encoded or loaded.", s.encoder_misses)
        for name, value in self.extra().items():
            kind, _, metric = name.partition(" ")
            yield counter(metric, metric, value) if kind == "counter" else gauge(metric, metric, value)


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats],
                 extra: Callable[[], dict[str, float]] = dict) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", labels,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    labels, buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(model_name, stats, extra))
        self._last_token_time: dict[str, float] = {}

    def on_output(self, out: RequestOutput) -> None:
        """Account one engine output (called on the event loop for every output of every request)."""
        name = self.model_name
        now = time.monotonic()
        n_new = len(out.new_token_ids)
        if n_new:
            self.generation_tokens.labels(name).inc(n_new)
            previous = self._last_token_time.get(out.request_id)
            if previous is None:
                self.ttft.labels(name).observe(now - out.arrival_time)
            else:
                gap = (now - previous) / n_new  # tokens that arrive together share their gap
                for _ in range(n_new):
                    self.itl.labels(name).observe(gap)
            self._last_token_time[out.request_id] = now
        if not out.finished:
            return
        self._last_token_time.pop(out.request_id, None)
        self.prompt_tokens.labels(name).inc(out.num_prompt_tokens)
        self.request_success.labels(name, out.finish_reason or "unknown").inc()
        self.e2e.labels(name).observe(now - out.arrival_time)
        if "first_scheduled" in out.metrics:
            self.queue_time.labels(name).observe(out.metrics["first_scheduled"] - out.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
