"""How a vLLM instance with PdConnector says so: an info metric on vLLM's own /metrics.

The gateway learns what an instance is by asking it. vLLM serves no pdserve endpoint (404 at /v1/pdserve/info),
but it serves /metrics, and a connector may register metric families in the API server process, where /metrics
lives (`build_prom_metrics`). `pdserve:kv_connector_info` (always 1) carries in its labels what the gateway needs:
the connector, the protocols it serves inside vLLM, and the side channel (engine id, host, port).

What the connector holds for transfers in flight comes through vLLM's connector stats (the worker reports them
each step) as gauges under a pdserve instance's names, so "nothing held" is checked alike on both engines.
"""

from __future__ import annotations

from typing import Any

from pdserve.integrations.vllm.settings import PROTOCOLS, read_settings

INFO_METRIC = "pdserve:kv_connector_info"
INFO_LABELS = ("kv_connector", "protocols", "engine_id", "side_channel_host", "side_channel_port")
HELD_GAUGES = {
    "pdserve:kv_leases_held": "Prompts' KV held for a decode instance to read.",
    "pdserve:kv_push_expected": "Block registrations waiting for a prefill instance's write-done.",
    "pdserve:kv_transfer_map_size": "Transfer ids mapped to this instance's requests.",
}


def make_prom_metrics(base: type, vllm_config: Any, metric_types: dict, labelnames: list[str],
                      per_engine_labelvalues: dict[int, list[object]]) -> Any:
    """An instance of vLLM's `KVConnectorPromMetrics` (`base`) that has registered the info metric."""

    class PdConnectorInfo(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            s = read_settings(vllm_config)
            gauge = self._gauge_cls(name=INFO_METRIC, documentation="PdConnector (pdserve's KV transfer) serves "
                                    "this instance: its protocols and side channel", labelnames=list(INFO_LABELS))
            gauge.labels("PdConnector", ",".join(PROTOCOLS), s.engine_id, s.host, str(s.port)).set(1)
            self.held = {name: self._gauge_cls(name=name, documentation=doc, labelnames=labelnames)
                         for name, doc in HELD_GAUGES.items()}

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for name, value in transfer_stats_data.items():
                if name in self.held:
                    self.held[name].labels(*self.per_engine_labelvalues[engine_idx]).set(value)

    return PdConnectorInfo()
