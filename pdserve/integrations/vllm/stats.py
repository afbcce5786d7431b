"""pdserve's transfer counters and gauges on vLLM's /metrics.

The transfer agent lives in vLLM's worker, /metrics in its API server: vLLM carries a connector's stats from one
to the other with each step's output (`get_kv_connector_stats`), then hands them to the connector's Prometheus
metrics (`observe`). The worker sends a snapshot of every value, and only when one changed; the API server sets
the gauges and advances each counter by what it grew since the last snapshot.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from pdserve.kv_store.metrics import STORE_METRICS
from pdserve.kv_transfer.metrics import TRANSFER_METRICS

METRICS = TRANSFER_METRICS + STORE_METRICS  # the store tier's stay 0 where no store is configured

# What vLLM's periodic "KV Transfer metrics" log line shows (all of them are on /metrics).
_LOGGED = ("pdserve:kv_transfer_loads_ok", "pdserve:kv_transfer_loads_failed", "pdserve:kv_transfer_bytes_received",
           "pdserve:kv_leases_held")


class PdTransferStats(KVConnectorStats):
    """A snapshot of `TRANSFER_METRICS` (and `STORE_METRICS`, with a store) by name. An instance has one worker
    (the side channel's port is one), so aggregating keeps the newest value of each."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data.update(other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name.removeprefix("pdserve:"): self.data[name] for name in _LOGGED if name in self.data}

    def is_empty(self) -> bool:
        return not self.data


class TransferGauges:
    """The API server's end: a Prometheus child per metric and engine, and the counters' last snapshot."""

    def __init__(self, gauge_cls: Any, counter_cls: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        self._children: dict[tuple[int, str], Any] = {}
        self._kinds = {m.name: m.kind for m in METRICS}
        self._last: dict[tuple[int, str], float] = {}
        for metric in METRICS:
            cls = counter_cls if metric.kind == "counter" else gauge_cls
            family = cls(name=metric.name, documentation=metric.doc, labelnames=labelnames)
            for engine, labelvalues in per_engine_labelvalues.items():
                self._children[(engine, metric.name)] = family.labels(*labelvalues)

    def observe(self, data: dict[str, Any], engine: int) -> None:
        for name, value in data.items():
            child = self._children.get((engine, name))
            if child is None:  # a name from a newer or older pdserve in the worker
                continue
            if self._kinds[name] == "gauge":
                child.set(value)
                continue
            last = self._last.get((engine, name), 0.0)
            # A counter below its last value means the worker restarted: it counts from zero again.
            child.inc(value - last if value >= last else value)
            self._last[(engine, name)] = value
