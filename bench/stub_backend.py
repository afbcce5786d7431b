"""An instant stub backend for router overhead benchmarks (a test double, named as one: it runs no model).

It answers like a vLLM/pdserve instance would, instantly: a prefill leg (a body with "do_remote_decode")
gets a one-token completion with NIXL-shaped kv_transfer_params; anything else gets a short completion (JSON,
or SSE when the body asks to stream). /health and /metrics answer too. Kept minimal (asyncio + httptools) so
that the backends cost the 2-core box as little as possible and the router's own cost stands out.

    python bench/stub_backend.py --port 8100 [--role prefill|decode]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

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


def response(status: bytes, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


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


class StubProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body = bytearray()

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

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
            kind = "not_found"
        elif b"do_remote_decode\":true" in body.replace(b" ", b""):
            kind = "prefill"
        elif b"\"stream\":true" in body.replace(b" ", b""):
            kind = "stream"
        else:
            kind = "decode"
        self.transport.write(RESPONSES[kind])


async def main(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(StubProtocol, "127.0.0.1", port, backlog=1024)
    print(json.dumps({"event": "ready", "port": server.sockets[0].getsockname()[1], "pid": os.getpid()}), flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--role", default="any", help="ignored: the body decides (kept for symmetry with routers)")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(args.port))
