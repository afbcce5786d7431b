"""How a vLLM instance with PdConnector says so: an info metric on vLLM's own /metrics.

The gateway learns what an instance is by asking it. vLLM serves no pdserve endpoint (404 at /v1/pdserve/info),
but it serves /metrics, and a connector may register metric families in the API server process, where /metrics
lives (`build_prom_metrics`). `pdserve:kv_connector_info` (always 1) carries in its labels what the gateway needs:
the connector, the protocols it serves inside vLLM, the side channel (engine id, host, port), and, on vLLM-CPU,
its KV layout and block size and the layout it regroups when it reads (pdserve's), so the gateway pairs it with
pdserve instances whose blocks either end can regroup. The same
object shows pdserve's transfer counters and gauges, as a pdserve instance does (`stats.py`).
"""

from __future__ import annotations

from typing import Any

from pdserve.integrations.vllm.settings import PROTOCOLS, read_settings
from pdserve.integrations.vllm.stats import TransferGauges
from pdserve.kv_transfer.layouts import PDSERVE, VLLM_CPU

INFO_METRIC = "pdserve:kv_connector_info"
INFO_LABELS = ("kv_connector", "protocols", "engine_id", "side_channel_host", "side_channel_port", "kv_layout",
               "kv_block_size", "kv_sources")


def make_prom_metrics(base: type, vllm_config: Any, metric_types: dict, labelnames: list[str],
                      per_engine_labelvalues: dict[int, list[object]]) -> Any:
    """An instance of vLLM's `KVConnectorPromMetrics` (`base`) that has registered the info metric and the
    transfer metrics."""

    class PdConnectorInfo(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            from vllm.platforms import current_platform

            s = read_settings(vllm_config)
            # Only vLLM-CPU's layout is one pdserve regroups (its caches are on the host, keys dimension-major).
            layout, sources = (VLLM_CPU, PDSERVE) if current_platform.is_cpu() else ("", "")
            gauge = self._gauge_cls(name=INFO_METRIC, documentation="PdConnector (pdserve's KV transfer) serves "
                                    "this instance: its protocols and side channel", labelnames=list(INFO_LABELS))
            gauge.labels("PdConnector", ",".join(PROTOCOLS), s.engine_id, s.host, str(s.port), layout,
                         str(s.block_size), sources).set(1)
            self.transfers = TransferGauges(self._gauge_cls, self._counter_cls, labelnames, per_engine_labelvalues)

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            self.transfers.observe(transfer_stats_data, engine_idx)

    return PdConnectorInfo()
