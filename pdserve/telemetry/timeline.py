"""Per-request timelines: what happened to a request, when, on this process.

Every instance and the gateway record a few events per request (arrival, queued, scheduled, each prefill chunk,
KV transfer start and end, first token, finish; at the gateway each leg's start, first byte and end) with
wall-clock nanoseconds, so the timelines of one request on the gateway, P and D share one axis on a host. They
are served at ``GET /v1/timeline/{request_id}`` (the client-visible ``X-Request-Id``), exported as
OpenTelemetry spans when tracing is on, and read by the benchmarks instead of instrumenting product code.

Recording is a list append: the engine thread and the event loop both write, and CPython appends atomically.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.ids import TransferId

# Enough for every request of a long benchmark run; older ones are forgotten first.
DEFAULT_CAPACITY = 4096


@dataclass(slots=True)
class Timeline:
    """One request's events on one process. `request_id` is the client-visible id, shared by every leg."""

    request_id: str
    role: str
    internal_request_id: str | None = None
    transfer_id: TransferId | None = None
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    traceparent: str | None = None  # the W3C trace context this request arrived with, if any
    on_finish: Callable[[Timeline], None] | None = None  # the exporter's hook (tracing on)
    trace: Any = None  # this request's place in a trace (tracing on)

    def add(self, name: str, time_ns: int | None = None, **attrs: Any) -> None:
        self.events.append((name, time.time_ns() if time_ns is None else time_ns, attrs))

    def record(self, name: str, attrs: dict[str, Any]) -> None:
        """`add` now, for a caller that already holds the attributes in a dict (no second copy of them)."""
        self.events.append((name, time.time_ns(), attrs))

    def finish(self, **attrs: Any) -> None:
        self.add("finish", **attrs)
        if self.on_finish is not None:
            self.on_finish(self)

    def first(self, name: str) -> int | None:
        """The time of the first event with this name, if any."""
        for event, at, _ in list(self.events):
            if event == name:
                return at
        return None

    def to_json(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "internal_request_id": self.internal_request_id,
                "transfer_id": self.transfer_id, "role": self.role,
                "events": [{"name": n, "time_ns": t, "attrs": a} for n, t, a in list(self.events)]}


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a request came from: its client-visible id, when it arrived, and the trace it belongs to."""

    request_id: str
    arrival_ns: int
    traceparent: str | None = None
    access: Any = None  # the access-log record (pdserve.net.front) the serving reports token counts to
    spliced: bool = False  # it came through a gateway that splices the stream of a request that moves


def wall_ns_of(monotonic_s: float) -> int:
    """Wall-clock ns of a `time.monotonic()` reading (transfer code times itself on the monotonic clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class TimelineStore:
    """The timelines of the last `capacity` request ids, live and finished; one per process, never global."""

    def __init__(self, exporter: Any = None, capacity: int = DEFAULT_CAPACITY) -> None:
        self.exporter = exporter  # a tracing.TimelineExporter when tracing is on
        self.capacity = capacity
        self._lock = threading.Lock()
        self._by_id: OrderedDict[str, list[Timeline]] = OrderedDict()

    def start(self, request_id: str, role: str, arrival_ns: int | None = None, **ids: Any) -> Timeline:
        """A new timeline with its `arrival` event, findable by `request_id` from now on."""
        timeline = Timeline(request_id, role, **ids)
        if self.exporter is not None:
            timeline.on_finish = self.exporter.export
            self.exporter.start(timeline)
        timeline.add("arrival", arrival_ns)
        with self._lock:
            found = self._by_id.get(request_id)
            if found is None:  # most ids are new: added last, where move_to_end would put them
                self._by_id[request_id] = [timeline]
            else:
                found.append(timeline)
                self._by_id.move_to_end(request_id)
            while len(self._by_id) > self.capacity:
                self._by_id.popitem(last=False)
        return timeline

    def get(self, request_id: str) -> list[Timeline]:
        with self._lock:
            return list(self._by_id.get(request_id, ()))
