"""How long each side of a migration waits for the other (every wait has a deadline)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MigrationSettings:
    # Source: how long a request whose stream ended with a Handoff waits for the gateway to come back for the rest
    # (longer, and its client is taken to be gone: the request is aborted).
    attach_timeout_s: float = 10.0
    # Source: one copy stage, the target's read of its blocks included.
    stage_timeout_s: float = 30.0
    # Source: how long to wait for the request to be between two decode steps before stopping it.
    pause_wait_s: float = 2.0
    # Target: blocks of a migration whose next stage does not come within this are freed (the source's lease on
    # its own blocks is as long: neither side holds anything longer than a lease).
    idle_timeout_s: float = 30.0
    # Target: a request taken over but never attached by a gateway within this is aborted (its client is gone).
    unattached_timeout_s: float = 10.0
    # Source: the pace of a live migration's bulk copy, in bytes per second (0: as fast as the plane goes). The
    # copy costs the target's CPU (and the plane's); paced, it takes a bounded share of each of the target's decode
    # steps instead of stalling a few, the way live VM migration caps its bandwidth. A move may set its own.
    rate_bytes_per_s: float = 0.0

    @classmethod
    def for_lease(cls, lease_s: float, rate_bytes_per_s: float = 0.0) -> MigrationSettings:
        return cls(idle_timeout_s=lease_s, stage_timeout_s=lease_s, rate_bytes_per_s=rate_bytes_per_s)
