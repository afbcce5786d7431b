"""An instant stub backend for router overhead benchmarks (a test double, named as one: it runs no model).

It answers like a vLLM 0.32 NixlConnector instance (`--kind vllm`, the default) or a pdserve instance
(`--kind pdserve`) would, instantly: a prefill leg (a body with "do_remote_decode") gets a one-token completion
with that engine's kv_transfer_params (vLLM NIXL's; pdserve's pull or push shape, with its transfer token);
anything else gets a short completion (JSON, or SSE when the body asks to stream). /health, /metrics and /version
answer too; a pdserve stub also describes itself at /v1/pdserve/info (its KV connector, side channel and
protocols, so a gateway pairs it for pull, push and decode-first) and answers with the headers a pdserve instance
writes (date, server, x-request-id, x-pdserve-request-ids). Kept minimal (asyncio + httptools) so that the
backends cost the 2-core box as little as possible and the router's own cost stands out.

    python bench/stub_backend.py --port 8100 [--role prefill|decode] [--kind vllm|pdserve]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from email.utils import formatdate

import httptools

PREFILL_BODY = json.dumps({
    "id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "text": " a", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5,
              "prompt_tokens_details": {"cached_tokens": 0}},
    "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
                           "remote_engine_id": "stub-engine", "remote_request_id": "cmpl-stub-0-abcd1234",
                           "remote_host": "127.0.0.1", "remote_port": 9100, "tp_size": 1},
}).encode()
DECODE_BODY = json.dumps({
    "id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "text": " a b c d", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
              "prompt_tokens_details": {"cached_tokens": 0}},
    "kv_transfer_params": None,
}).encode()
STREAM_BODY = b"".join(
    b'data: {"id":"cmpl-stub","object":"text_completion","created":0,"model":"stub","choices":[{"index":0,"text":"'
    + t + b'","finish_reason":' + f + b"}]}\n\n" for t, f in ((b" a", b"null"), (b" b", b"null"), (b" c", b"null"),
                                                                (b" d", b'"length"'))) + b"data: [DONE]\n\n"
METRICS = (b"vllm:num_requests_running{model_name=\"stub\"} 0.0\nvllm:num_requests_waiting{model_name=\"stub\"} 0.0\n"
           b"vllm:kv_cache_usage_perc{model_name=\"stub\"} 0.0\n"
           # vLLM's NixlConnector adds its metrics: the gateway learns from them that the stub takes part in pull.
           b"vllm:nixl_num_failed_transfers_total{model_name=\"stub\"} 0.0\n")


# What a pdserve prefill instance answers (pull, and push: PushHeld), as kv_transfer/params.py writes it. Its
# usage always has details; its decode partner counts the same prompt and reports P's cache hits as its own.
PD_USAGE = {"prompt_tokens": 12, "total_tokens": 13, "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 0}}
# A pdserve decode instance: no kv_transfer_params, and P's prompt and cache hits in its usage.
PD_DECODE_BODY = json.dumps({**{k: v for k, v in json.loads(DECODE_BODY).items() if k != "kv_transfer_params"},
                             "usage": {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16,
                                       "prompt_tokens_details": {"cached_tokens": 0}}}).encode()
PD_PULL_BODY = json.dumps({
    "id": "cmpl-stub-0", "object": "text_completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "text": " a", "finish_reason": "length", "stop_reason": None, "logprobs": None}],
    "usage": PD_USAGE, "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]],
        "remote_engine_id": "0b5c7f6e-7d6a-4c1e-9a51-2f8d3e4b6c7a", "remote_request_id": "cmpl-stub-0-1a2b3c4d",
        "remote_host": "127.0.0.1", "remote_port": 9100, "tp_size": 1, "transfer_token": "Zt1yQn3w5pR8sV0xA2cE4g",
        "remote_num_tokens": 12, "transfer_mode": "pull", "remote_prefill_cached_tokens": 0,
        "transfer_id": "xfer-6f1d2c3b-4a5e-4f60-8b7c-9d0e1f2a3b4c", "remote_prompt_hash": "9f8e7d6c5b4a39281706f5e4d3c2b1a0"},
}).encode()
PD_PUSH_BODY = json.dumps({
    "id": "cmpl-stub-0", "object": "text_completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "text": " a", "finish_reason": "length", "stop_reason": None, "logprobs": None}],
    "usage": PD_USAGE, "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "xfer-6f1d2c3b-4a5e-4f60-8b7c-9d0e1f2a3b4c",
        "transfer_mode": "push", "remote_num_tokens": 12, "remote_prefill_cached_tokens": 0},
}).encode()


def pdserve_info(role: str) -> bytes:
    """What /v1/pdserve/info says on a pdserve instance with PdConnector (server/info.py's InstanceInfo)."""
    return json.dumps({"version": 1, "engine": "pdserve", "engine_version": "0.1.0", "role": role,
                       "kv_connector": "PdConnector", "data_planes": ["shm", "tcp"],
                       "protocols": ["pull", "push", "decode-first"], "engine_id": f"stub-{role}",
                       "side_channel_host": "127.0.0.1", "side_channel_port": 9100, "kv_sources": [],
                       "kv_sinks": [], "kv_layout": "pdserve", "kv_block_size": 16}).encode()


def response(status: bytes, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def pdserve_response(status: bytes, body: bytes, request_id: bytes, content_type: bytes = b"application/json"
                     ) -> bytes:
    """The head uvicorn writes for a pdserve instance's completion: date, server, its request-id headers."""
    return (b"HTTP/1.1 " + status + b"\r\ndate: " + formatdate(usegmt=True).encode() + b"\r\nserver: uvicorn\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\ncontent-type: " + content_type
            + b"\r\nx-request-id: " + request_id + b"\r\nx-pdserve-request-ids: cmpl-" + request_id
            + b"-0-1a2b3c4d\r\n\r\n" + body)


RESPONSES = {
    "prefill": response(b"200 OK", PREFILL_BODY),
    "decode": response(b"200 OK", DECODE_BODY),
    "stream": response(b"200 OK", STREAM_BODY, b"text/event-stream"),
    "health": response(b"200 OK", b""),
    "metrics": response(b"200 OK", METRICS, b"text/plain"),
    "models": response(b"200 OK", b'{"object":"list","data":[{"id":"stub","object":"model"}]}'),
    "version": response(b"200 OK", b'{"version":"0.32.0"}'),  # it answers as vLLM does
    "not_found": response(b"404 Not Found", b'{"detail":"Not Found"}'),
}
# A pdserve instance: the same, but it says what it is at /v1/pdserve/info and hands out its own KV parameters.
PDSERVE_BODIES = {"prefill": (PD_PULL_BODY, b"application/json"), "push": (PD_PUSH_BODY, b"application/json"),
                  "decode": (PD_DECODE_BODY, b"application/json"),
                  "stream": (STREAM_BODY, b"text/event-stream")}


class StubProtocol(asyncio.Protocol):
    def __init__(self, kind: str = "vllm", role: str = "any") -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body = bytearray()
        self.request_id = b"-"
        self.pdserve = kind == "pdserve"
        self.responses = {**RESPONSES, "info": response(b"200 OK", pdserve_info(role))} if self.pdserve else RESPONSES

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.pdserve and name.lower() == b"x-request-id":
            self.request_id = value

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        url, body = self.url, bytes(self.body)
        self.url, self.body = b"", bytearray()
        if url.startswith(b"/health"):
            kind = "health"
        elif url.startswith(b"/metrics"):
            kind = "metrics"
        elif url.startswith(b"/v1/models"):
            kind = "models"
        elif url.startswith(b"/version"):
            kind = "version"
        elif url.startswith(b"/v1/pdserve/info"):
            kind = "info" if self.pdserve else "not_found"
        elif b"do_remote_decode\":true" in body.replace(b" ", b""):
            kind = "push" if self.pdserve and b"\"transfer_mode\":\"push\"" in body else "prefill"
        elif b"\"stream\":true" in body.replace(b" ", b""):
            kind = "stream"
        else:
            kind = "decode"
        if self.pdserve and kind in PDSERVE_BODIES:
            body, content_type = PDSERVE_BODIES[kind]
            self.transport.write(pdserve_response(b"200 OK", body, self.request_id, content_type))
        else:
            self.transport.write(self.responses[kind])
        self.request_id = b"-"


async def main(port: int, kind: str, role: str) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: StubProtocol(kind, role), "127.0.0.1", port, backlog=1024)
    print(json.dumps({"event": "ready", "port": server.sockets[0].getsockname()[1], "pid": os.getpid()}), flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--role", default="any", help="what a pdserve stub's info says (the body decides answers)")
    parser.add_argument("--kind", default="vllm", choices=["vllm", "pdserve"], help="which engine it answers as")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(args.port, args.kind, args.role))
