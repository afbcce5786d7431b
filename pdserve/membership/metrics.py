"""The gateway's membership metrics: members by role and state, changes by cause, stores it cannot reach.

* `pdserve:gateway_instances{role,state}`: members now; state `healthy` (gets traffic), `unhealthy` (its breaker
  is open or it has not yet passed a health check) or `draining` (it said so; no new work).
* `pdserve:gateway_membership_changes{cause}`: joined, left, lease_expired, not_ready, relist_correction.
* `pdserve:gateway_membership_stale{source}`: 1 while that backend cannot reach its store and the gateway serves
  the members it last listed.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.membership.discovery import JOINED, LEASE_EXPIRED, LEFT, NOT_READY, RELIST_CORRECTION
from pdserve.membership.membership import Membership
from pdserve.membership.record import ROLES

STATES = ("healthy", "unhealthy", "draining")
CAUSES = (JOINED, LEFT, LEASE_EXPIRED, NOT_READY, RELIST_CORRECTION)


class MembershipCollector:
    def __init__(self, membership: Membership, registry) -> None:
        self.membership = membership
        self.registry = registry  # the gateway's Registry (its instances, their breakers)

    def collect(self):
        counts = {(role, state): 0 for role in ROLES for state in STATES}
        for instance in list(self.registry.instances.values()):
            state = "draining" if instance.draining else "healthy" if instance.breaker.closed else "unhealthy"
            counts[(instance.role, state)] += 1
        instances = GaugeMetricFamily("pdserve:gateway_instances", "Members by role and state: healthy (gets "
                                      "traffic), unhealthy (breaker not closed), draining (no new work).",
                                      labels=["role", "state"])
        for (role, state), count in counts.items():
            instances.add_metric([role, state], count)
        yield instances
        changes = CounterMetricFamily("pdserve:gateway_membership_changes", "Membership changes by cause: joined, "
                                      "left, lease_expired, not_ready, relist_correction (a change the backend's "
                                      "change feed missed, found by a full list).", labels=["cause"])
        for cause in CAUSES:
            changes.add_metric([cause], self.membership.changes.get(cause, 0))
        yield changes
        stale = GaugeMetricFamily("pdserve:gateway_membership_stale", "1 while a discovery backend cannot reach "
                                  "its store (the gateway serves the members it last listed).", labels=["source"])
        for source in self.membership.sources:
            stale.add_metric([source.name], 1.0 if source.name in self.membership.stale else 0.0)
        yield stale
