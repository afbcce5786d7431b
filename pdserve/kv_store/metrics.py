"""The store tier's counters and gauges, named once: what /metrics shows on a pdserve instance (read at scrape
time) and inside vLLM (sent with each step's connector stats, as the transfer metrics are)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.kv_store.codec import REASONS
from pdserve.kv_transfer.metrics import TransferMetric


@dataclass(slots=True)
class StoreStats:
    """Bumped by the tier's threads and the engine thread; plain ints, read across threads at scrape time."""

    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    write_refused: int = 0
    writes_dropped: int = 0
    errors: int = 0
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    up: int = 1
    queued_bytes: int = 0


_COUNTERS = (  # in StoreStats' order, as `store_metric_values` reads them
    ("lookups", "Requests whose prompt blocks were looked up in the KV store."),
    ("lookup_blocks", "Prompt blocks looked up in the KV store (past the local prefix-cache hit)."),
    ("hit_blocks", "Blocks loaded from the KV store and used (not computed)."),
    ("miss_blocks", "Blocks looked up that the KV store did not have or could not serve (computed instead)."),
    ("bytes_read", "KV bytes loaded from the KV store and used."),
    ("bytes_written", "KV bytes written to the KV store."),
    ("blocks_written", "Blocks written to the KV store."),
    ("write_refused", "Blocks the KV store refused to take (full)."),
    ("writes_dropped", "Blocks not written: the write queue was full or the store unreachable."),
    ("errors", "KV store calls that failed or ran past their deadline."),
)
STORE_METRICS = (
    *(TransferMetric("counter", f"pdserve:kv_store_{name}", doc) for name, doc in _COUNTERS),
    *(TransferMetric("counter", f"pdserve:kv_store_refused_{reason}",
                     f"Stored blocks refused as unusable: {reason}.") for reason in REASONS),
    TransferMetric("gauge", "pdserve:kv_store_up", "1 while the KV store answers, 0 while it is left alone after a "
                   "failure."),
    TransferMetric("gauge", "pdserve:kv_store_write_queue_bytes", "Staged KV bytes waiting to be written."),
)


def store_metric_values(stats: StoreStats) -> dict[str, float]:
    """Every `STORE_METRICS` value now, by name."""
    s = stats
    values = (s.lookups, s.lookup_blocks, s.hit_blocks, s.miss_blocks, s.bytes_read, s.bytes_written,
              s.blocks_written, s.write_refused, s.writes_dropped, s.errors, *(s.refused[r] for r in REASONS), s.up,
              s.queued_bytes)
    return {metric.name: float(value) for metric, value in zip(STORE_METRICS, values, strict=True)}
