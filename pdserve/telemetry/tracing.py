"""OpenTelemetry spans from request timelines, with W3C trace context carried gateway → P → D (and E).

Optional (`pip install 'pdserve[tracing]'`) and off unless `--otlp-traces-endpoint` is given; when off nothing
here is imported and no request does any tracing work. When on, each process turns a finished timeline into
spans after the fact — a request span with one child per phase (queue, KV transfer, prefill, decode; at the
gateway one per leg) — and hands them to a batching OTLP/HTTP exporter. Spans are built from the timeline's own
timestamps, so tracing adds no work to the engine step beyond what the timeline already records.

The only live part is the trace context: the gateway mints (or continues) a trace at arrival and a span id per
leg, and sends `traceparent: 00-<trace>-<leg span>-01` with the leg, so an instance's request span is a child
of the gateway's leg span and one trace shows every leg.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from pdserve.telemetry.timeline import Timeline

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")

# Phases of an instance's request: (span name, the event that opens it, the events that may close it).
_PHASES = (
    ("queue", "queued", ("kv_transfer_start", "scheduled", "finish")),
    ("kv_transfer", "kv_transfer_start", ("kv_transfer_end",)),
    ("prefill", "scheduled", ("first_token", "finish")),
    ("decode", "first_token", ("finish",)),
    ("encode", "encode_start", ("encode_end",)),
)


@dataclass(frozen=True, slots=True)
class TraceContext:
    """This process's part of a trace: the trace, its request span, and the caller's span if it had one."""

    trace_id: int
    span_id: int
    parent_id: int | None = None

    def traceparent_for(self, span_id: int) -> str:
        """The header that makes a downstream request a child of `span_id` (one of ours) in this trace."""
        return f"00-{self.trace_id:032x}-{span_id:016x}-01"


def new_span_id() -> int:
    return random.getrandbits(64) or 1


def context_for(traceparent: str | None) -> TraceContext:
    """Continue the caller's trace if it sent a valid W3C `traceparent`, else start a new one."""
    match = _TRACEPARENT.match(traceparent or "")
    if match and int(match.group(1), 16) and int(match.group(2), 16):
        return TraceContext(int(match.group(1), 16), new_span_id(), int(match.group(2), 16))
    return TraceContext(random.getrandbits(128) or 1, new_span_id())


class TimelineExporter:
    """Turns finished timelines into OTLP spans, exported in batches on the SDK's own thread."""

    def __init__(self, endpoint: str, service_name: str) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise ValueError("--otlp-traces-endpoint needs the tracing extra: pip install 'pdserve[tracing]'") from exc
        self.resource = Resource.create({"service.name": service_name})
        self.processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=_traces_url(endpoint)))

    def start(self, timeline: Timeline) -> None:
        """Called when a timeline opens: fix its place in the trace."""
        timeline.trace = context_for(timeline.traceparent)

    def export(self, timeline: Timeline) -> None:
        """Called when a timeline finishes: its spans go to the batch processor (a queue put each)."""
        trace = timeline.trace
        if not isinstance(trace, TraceContext) or not timeline.events:
            return
        events = list(timeline.events)
        start, end = events[0][1], events[-1][1]
        attrs = {"pdserve.request_id": timeline.request_id, "pdserve.role": timeline.role}
        if timeline.internal_request_id:
            attrs["pdserve.internal_request_id"] = timeline.internal_request_id
        if timeline.transfer_id:
            attrs["pdserve.transfer_id"] = timeline.transfer_id
        self._emit(f"{timeline.role} request", trace, trace.span_id, trace.parent_id, start, end, attrs, "server")
        gateway = timeline.role == "gateway"
        children = _leg_spans(events) if gateway else _phase_spans(events)
        for name, span_id, begin, finish, span_attrs in children:
            self._emit(name, trace, span_id, trace.span_id, begin, finish, span_attrs,
                       "client" if gateway else "internal")

    def shutdown(self) -> None:
        self.processor.shutdown()

    def _emit(self, name: str, trace: TraceContext, span_id: int, parent_id: int | None, start: int, end: int,
              attrs: dict[str, Any], kind: str) -> None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

        flags = TraceFlags(TraceFlags.SAMPLED)
        context = SpanContext(trace.trace_id, span_id, is_remote=False, trace_flags=flags)
        parent = SpanContext(trace.trace_id, parent_id, is_remote=True, trace_flags=flags) if parent_id else None
        self.processor.on_end(ReadableSpan(name, context=context, parent=parent, resource=self.resource,
                                           attributes=attrs, kind=SpanKind[kind.upper()], start_time=start,
                                           end_time=max(start, end)))


def _traces_url(endpoint: str) -> str:
    """vLLM's flag takes the collector's address; OTLP/HTTP posts traces to its /v1/traces."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"


def _phase_spans(events: list[tuple[str, int, dict]]) -> list[tuple[str, int, int, int, dict]]:
    spans = []
    for name, opens, closes in _PHASES:
        begin = next((e for e in events if e[0] == opens), None)
        if begin is None:
            continue
        later = [e for e in events if e[0] in closes and e[1] >= begin[1]]
        end = later[0] if later else events[-1]
        attrs = {k: v for k, v in {**begin[2], **end[2]}.items() if isinstance(v, (str, int, float, bool))}
        spans.append((name, new_span_id(), begin[1], end[1], attrs))
    return spans


def _leg_spans(events: list[tuple[str, int, dict]]) -> list[tuple[str, int, int, int, dict]]:
    spans = []
    for i, (name, at, attrs) in enumerate(events):
        if name != "leg_start" or "span_id" not in attrs:
            continue
        end = next((e for e in events[i + 1:] if e[0] == "leg_end" and e[2].get("span_id") == attrs["span_id"]),
                   events[-1])
        span_attrs = {"pdserve.leg": attrs["leg"], "server.address": attrs["url"],
                      "http.response.status_code": end[2].get("status", 0)}
        spans.append((f"leg {attrs['leg']}", attrs["span_id"], at, end[1], span_attrs))
    return spans


def make_exporter(endpoint: str | None, service_name: str) -> TimelineExporter | None:
    return TimelineExporter(endpoint, service_name) if endpoint else None
