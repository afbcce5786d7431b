"""pdserve's transfer counters and gauges, named once: what /metrics shows wherever the connector runs, on a
pdserve server (read at scrape time) and inside vLLM (sent with each step's connector stats)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.kv_transfer.agent import TransferAgent
    from pdserve.kv_transfer.pd_connector import PdConnectorWorker


@dataclass(frozen=True, slots=True)
class TransferMetric:
    kind: str  # "counter" or "gauge"
    name: str
    doc: str


TRANSFER_METRICS = (
    TransferMetric("counter", "pdserve:kv_transfer_bytes_received", "KV bytes loaded from producers."),
    TransferMetric("counter", "pdserve:kv_transfer_loads_ok", "KV loads that completed."),
    TransferMetric("counter", "pdserve:kv_transfer_loads_failed", "KV loads that failed (the policy then recomputes "
                   "or fails the request)."),
    TransferMetric("counter", "pdserve:kv_transfer_load_seconds", "Seconds spent in completed KV loads."),
    TransferMetric("counter", "pdserve:kv_lease_expired_requests", "Held KV freed because its lease ran out."),
    TransferMetric("counter", "pdserve:kv_releases_received", "Releases consumers sent for held KV."),
    TransferMetric("counter", "pdserve:kv_read_done_received", "Read-done messages consumers sent for held KV."),
    TransferMetric("counter", "pdserve:kv_handshake_refusals", "Handshakes refused as incompatible."),
    TransferMetric("counter", "pdserve:kv_reads_denied", "Block reads refused by the capability check."),
    TransferMetric("counter", "pdserve:kv_blocks_invalid", "Loaded blocks whose checksum did not match."),
    TransferMetric("gauge", "pdserve:kv_leases_held", "Transfers whose KV this producer holds for a consumer."),
    TransferMetric("gauge", "pdserve:kv_transfer_map_size", "Transfer ids mapped to requests in flight."),
    TransferMetric("gauge", "pdserve:kv_push_expected", "Pushes this consumer has registered and awaits."),
    TransferMetric("gauge", "pdserve:kv_blocks_quarantined", "KV blocks of transfers this consumer gave up on that a "
                   "peer may still be moving bytes into: held, not leaked, until it stopped."),
    TransferMetric("counter", "pdserve:kv_push_writes", "Layer writes pushed to consumers."),
    TransferMetric("counter", "pdserve:kv_push_bytes_sent", "KV bytes pushed to consumers."),
    TransferMetric("counter", "pdserve:kv_push_done_ok", "Pushes that completed."),
    TransferMetric("counter", "pdserve:kv_push_done_failed", "Pushes that failed."),
    TransferMetric("counter", "pdserve:kv_push_registration_timeouts", "Push registrations no producer fulfilled."),
    TransferMetric("counter", "pdserve:kv_push_unregistered_expired", "Pushes whose consumer never registered."),
)


def transfer_metric_values(agent: TransferAgent, worker: PdConnectorWorker) -> dict[str, float]:
    """Every `TRANSFER_METRICS` value now, by name."""
    s = agent.stats
    values = (s.bytes_received, s.loads_ok, s.loads_failed, s.load_seconds_total, s.leases_expired,
              s.releases_received, s.read_done_received, s.handshake_refusals, s.reads_denied, s.blocks_invalid,
              agent.num_leases(), len(worker.translator), agent.num_expected(), s.blocks_quarantined, s.push_writes, s.push_bytes_sent,
              s.push_done_ok, s.push_done_failed, s.push_registration_timeouts,
              worker.push.expired if worker.push else 0)
    return {metric.name: float(value) for metric, value in zip(TRANSFER_METRICS, values, strict=True)}
