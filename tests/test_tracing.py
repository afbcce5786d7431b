"""OpenTelemetry: one trace covers the gateway's legs and P's and D's spans, parented through `traceparent`.

A small OTLP/HTTP collector runs inside the test (the protobuf messages come from opentelemetry-proto, the
package the exporter itself uses); P, D and the gateway export to it with `--otlp-traces-endpoint`.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdserve.launcher import start, start_instance, stop_all

trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2",
                                    reason="the tracing extra (pdserve[tracing]) is not installed")

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "64", "--served-model-name", "tiny"]
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # ms: the batch processor flushes soon after each request


class Collector:
    """Receives OTLP/HTTP protobuf exports and keeps every span with its service name."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server interface
                body = self.rfile.read(int(self.headers["Content-Length"]))
                collector.add(trace_service.ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request) -> None:
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes
                           if a.key == "service.name")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attrs = {a.key: a.value.string_value or a.value.int_value for a in span.attributes}
                    with self.lock:
                        self.spans.append({"service": service, "name": span.name, "trace": span.trace_id.hex(),
                                           "id": span.span_id.hex(), "parent": span.parent_span_id.hex(),
                                           "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                                           "attrs": attrs})

    def of_request(self, request_id: str) -> list[dict]:
        with self.lock:
            roots = [s for s in self.spans if s["attrs"].get("pdserve.request_id") == request_id]
            traces = {s["trace"] for s in roots}
            return [s for s in self.spans if s["trace"] in traces]


@pytest.fixture(scope="module")
def traced(models):
    collector = Collector()
    model = models("qwen3")
    kv = lambda role: json.dumps({"kv_connector": "PdConnector", "kv_role": role})  # noqa: E731
    flags = ["--otlp-traces-endpoint", collector.url]
    procs = []
    try:
        procs.append(start_instance(model, *COMMON, *flags, "--kv-transfer-config", kv("kv_producer"), name="P",
                                    env=FAST_EXPORT))
        procs.append(start_instance(model, *COMMON, *flags, "--kv-transfer-config", kv("kv_consumer"), name="D",
                                    env=FAST_EXPORT))
        procs.append(start("gateway", ["gateway", "--prefill", procs[0].url, "--decode", procs[1].url, "--port", "0",
                                       "--log-level", "warning", *flags], env=FAST_EXPORT))
        yield collector, procs[2].url
    finally:
        stop_all(procs)
        collector.server.shutdown()


def wait_for_spans(collector: Collector, request_id: str, services: set[str], timeout: float = 20) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = collector.of_request(request_id)
        if {s["service"] for s in spans} >= services and len(spans) >= 9:
            time.sleep(0.3)  # the last batch of a process may still be on its way
            return collector.of_request(request_id)
        time.sleep(0.05)
    raise AssertionError(f"spans of {request_id} not all exported: {collector.of_request(request_id)}")


def test_one_trace_spans_the_gateway_p_and_d(traced):
    collector, gateway = traced
    request_id = f"trace-{uuid.uuid4().hex[:8]}"
    caller_trace, caller_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    answer = httpx.post(gateway + "/v1/completions", timeout=60,
                        headers={"X-Request-Id": request_id, "traceparent": f"00-{caller_trace}-{caller_span}-01"},
                        json={"model": "tiny", "prompt": list(range(5, 45)), "max_tokens": 3, "temperature": 0})
    assert answer.status_code == 200, answer.text

    spans = wait_for_spans(collector, request_id, {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"})
    assert {s["trace"] for s in spans} == {caller_trace}, "every process continues the caller's trace"
    by_name = {(s["service"], s["name"]): s for s in spans}
    root = by_name[("pdserve-gateway", "gateway request")]
    assert root["parent"] == caller_span
    for leg, service, role in (("prefill", "pdserve-prefill", "prefill"), ("decode", "pdserve-decode", "decode")):
        leg_span = by_name[("pdserve-gateway", f"leg {leg}")]
        assert leg_span["parent"] == root["id"]
        request_span = by_name[(service, f"{role} request")]
        assert request_span["parent"] == leg_span["id"], f"{role}'s request span is a child of the gateway's leg"
        assert leg_span["start"] <= request_span["start"] <= request_span["end"] <= leg_span["end"]
    for service, phase in (("pdserve-prefill", "prefill"), ("pdserve-decode", "kv_transfer"),
                           ("pdserve-decode", "decode")):
        span = by_name[(service, phase)]
        parent = next(s for s in spans if s["id"] == span["parent"])
        assert parent["name"].endswith(" request") and parent["service"] == service
    assert by_name[("pdserve-decode", "kv_transfer")]["attrs"]["bytes"] > 0
