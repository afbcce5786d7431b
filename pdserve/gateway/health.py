"""Whether an instance gets traffic: one circuit breaker per instance.

What counts against an instance is only what says it may be gone: a transport failure (refused, reset, broken
mid-answer), a timeout, a failed health check. An HTTP answer, whatever its status, proves the process is there:
a 4xx or a 5xx about one client's request is that client's error, never a reason to stop sending everyone else
there. Answers below 500 (and every streamed chunk) on real traffic are proof of life, and a health check that is
merely slow while such traffic succeeds is not held against the instance: a busy vLLM answers /health late.

    HALF_OPEN (unproven: a health check decides) --ok--> CLOSED --N consecutive failures--> OPEN
    OPEN --open_s later, a half-open health check--> HALF_OPEN --ok--> CLOSED, --failed--> OPEN
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class BreakerState(enum.Enum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    failure_threshold: int = 3  # consecutive failures that open the breaker
    open_s: float = 3.0  # how long an open breaker waits before its half-open health check
    probe_interval_s: float = 1.0  # health checks of instances that are not open
    probe_timeout_s: float = 2.0  # a health check slower than this failed (unless traffic proves life)
    liveness_window_s: float = 10.0  # traffic answered this recently excuses a slow health check

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or min(self.open_s, self.probe_interval_s, self.probe_timeout_s) <= 0:
            raise ValueError("breaker failures must be >= 1 and health intervals and timeouts > 0")


@dataclass(eq=False)
class Breaker:
    policy: HealthPolicy = field(default_factory=HealthPolicy)
    label: str = ""  # the instance's URL, for logs
    state: BreakerState = BreakerState.HALF_OPEN
    failures: int = 0  # consecutive
    opened_at: float = 0.0
    probed_at: float = float("-inf")
    last_alive: float = float("-inf")
    transitions: dict[tuple[str, str], int] = field(default_factory=dict)
    checks: dict[str, int] = field(default_factory=dict)  # health check results: ok, failed, slow_but_serving
    on_move: Callable[[], None] | None = None  # told of every change of state (the registry's epoch)

    @property
    def closed(self) -> bool:
        return self.state is BreakerState.CLOSED

    def alive(self) -> None:
        """Real traffic got an answer (status below 500) or a streamed chunk: the instance is serving."""
        self.failures = 0
        self.last_alive = time.monotonic()

    def failure(self, what: str) -> None:
        """A transport failure or a timeout on real traffic, or a failed health check."""
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN or (
                self.state is BreakerState.CLOSED and self.failures >= self.policy.failure_threshold):
            log.warning("instance %s: %s (%d in a row); breaker open, no traffic for %g s", self.label, what,
                        self.failures, self.policy.open_s)
            self.opened_at = time.monotonic()
            self._move(BreakerState.OPEN)

    def probe_due(self, now: float) -> bool:
        """Whether the health loop should check this instance now (an open breaker turns half-open when due)."""
        if self.state is BreakerState.OPEN:
            if now - self.opened_at < self.policy.open_s:
                return False
            self._move(BreakerState.HALF_OPEN)
        elif now - self.probed_at < self.policy.probe_interval_s:
            return False
        self.probed_at = now
        return True

    def probe_result(self, ok: bool, slow: bool, detail: str = "") -> None:
        if ok:
            self._count("ok")
            self.failures = 0
            if self.state is not BreakerState.CLOSED:
                log.info("instance %s passed its health check; breaker closed", self.label)
                self._move(BreakerState.CLOSED)
        elif slow and self.state is BreakerState.CLOSED and (
                time.monotonic() - self.last_alive <= self.policy.liveness_window_s):
            self._count("slow_but_serving")
        else:
            self._count("failed")
            self.failure(f"health check failed ({detail or 'no answer'})")

    def _count(self, result: str) -> None:
        self.checks[result] = self.checks.get(result, 0) + 1

    def _move(self, to: BreakerState) -> None:
        key = (self.state.value, to.value)
        self.transitions[key] = self.transitions.get(key, 0) + 1
        self.state = to
        if self.on_move is not None:
            self.on_move()
