"""`pdserve:gateway_kv_index_*`: what the prefix index holds and how its subscriptions fare."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.kv_events.index import PrefixIndex
from pdserve.kv_events.listener import Listener

_STATES = ("connecting", "replaying", "live", "degraded")
_PER_INSTANCE = {
    "gaps": "Sequence gaps seen (batches the publisher dropped or the network lost), each repaired by a replay "
            "or by clearing the instance.",
    "replays": "Replays asked for (on connect, after a gap or a restart).",
    "restarts": "Times the instance's sequence went back (its engine restarted): its entries were rebuilt.",
    "decode_errors": "Messages that were no KV event batch (foreign framing or an undecodable payload).",
    "disconnects": "Times the connection to the publisher was lost (its entries dropped until it is back).",
    "batches": "Event batches applied.",
}


class KVIndexCollector:
    def __init__(self, index: PrefixIndex, listener: Listener) -> None:
        self.index = index
        self.listener = listener

    def collect(self):
        # A scrape reads the index as of now. In the gateway's loop the live batches are otherwise applied only at a
        # pick and on the listener's timer (once a second), so a scrape right after a request would miss its blocks.
        self.listener.catch_up()
        held = GaugeMetricFamily("pdserve:gateway_kv_index_blocks", "Blocks the index credits to each instance "
                                 "(confirmed by its events).", labels=["instance"])
        for member, count in self.index.held_blocks().items():
            held.add_metric([member], count)
        yield held
        yield _gauge("pdserve:gateway_kv_index_entries", "Entries in the index (instance × block), all instances.",
                     self.index.size())
        yield _gauge("pdserve:gateway_kv_index_capacity", "Entries the index keeps at most (LRU bound).",
                     self.index.capacity)
        yield _gauge("pdserve:gateway_kv_index_native", "1 when the index applies events with its C core, 0 with "
                     "the Python one (the C core is not built on this machine).", float(self.index.native))
        stats = self.index.stats
        applied = CounterMetricFamily("pdserve:gateway_kv_index_events_applied", "KV events applied, by type.",
                                      labels=["type"])
        for kind, count in stats.events.items():
            applied.add_metric([kind], count)
        yield applied
        yield _counter("pdserve:gateway_kv_index_evictions", "Entries dropped by the LRU bound.", stats.evicted)
        yield _counter("pdserve:gateway_kv_index_orphan_blocks", "Blocks stored under a parent the index did not "
                       "know, or malformed (not indexed).", stats.orphans)
        yield _counter("pdserve:gateway_kv_index_clears", "Times an instance's entries were cleared (reset, "
                       "restart, loss, departure).", stats.cleared)
        yield from self._subscriptions()

    def _subscriptions(self):
        snapshot = self.listener.snapshot()
        state = GaugeMetricFamily("pdserve:gateway_kv_index_subscription_state", "1 for the state each "
                                  "instance's subscription is in (live: scored by its cache).",
                                  labels=["instance", "state"])
        families = {name: CounterMetricFamily(f"pdserve:gateway_kv_index_{name}", doc, labels=["instance"])
                    for name, doc in _PER_INSTANCE.items()}
        for member, (current, counters) in snapshot.items():
            for name in _STATES:
                state.add_metric([member, name], float(current == name))
            for name, family in families.items():
                family.add_metric([member], getattr(counters, name))
        yield state
        yield from families.values()


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc)
    family.add_metric([], value)
    return family

