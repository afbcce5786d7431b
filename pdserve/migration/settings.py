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

    @classmethod
    def for_lease(cls, lease_s: float) -> MigrationSettings:
        return cls(idle_timeout_s=lease_s, stage_timeout_s=lease_s)
