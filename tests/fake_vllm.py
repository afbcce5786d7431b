"""A fake vLLM instance (a test double, named as one): records every request and answers in vLLM's shapes.

It answers a prefill leg the way vLLM's NIXL producer does (one token, top-level kv_transfer_params) and any
other completion with a short answer (JSON, or SSE when asked to stream). It can be told to fail every POST
with a status, or to hang on POSTs, so gateway behaviour under failures can be tested.

    python tests/fake_vllm.py --record FILE [--fail-status 503] [--hang] [--engine-id ID]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket

from aiohttp import web


def make_app(args: argparse.Namespace) -> web.Application:
    counter = {"n": 0}

    def record(request: web.Request, body: object) -> None:
        with open(args.record, "a") as f:
            f.write(json.dumps({"path": request.path, "headers": {k.lower(): v for k, v in request.headers.items()},
                                "body": body}) + "\n")

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        record(request, body)
        if args.hang:
            await asyncio.sleep(3600)
        if args.fail_status:
            return web.json_response({"error": {"message": "injected failure", "type": "InternalServerError",
                                                "code": args.fail_status}}, status=args.fail_status)
        counter["n"] += 1
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            rid = f"cmpl-{request.headers.get('X-Request-Id', 'x')}-0-{counter['n']:08x}"
            return web.json_response({
                "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": body.get("model"),
                "choices": [{"index": 0, "text": " P", "finish_reason": "length", "logprobs": None}],
                "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8,
                          "prompt_tokens_details": {"cached_tokens": 3}},
                "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                       "remote_block_ids": [[1, 2, 3]], "remote_engine_id": args.engine_id,
                                       "remote_request_id": rid, "remote_host": "127.0.0.1", "remote_port": 5600,
                                       "tp_size": 1}})
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i, piece in enumerate([" a", " b", " c"]):
                finish = "length" if i == 2 else None
                chunk = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": body.get("model"),
                         "choices": [{"index": 0, "text": piece, "finish_reason": finish}]}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                     "prompt_tokens_details": {"cached_tokens": 7}}
            await response.write(b"data: " + json.dumps({"id": "cmpl-fake", "choices": [], "usage": usage}).encode()
                                 + b"\n\ndata: [DONE]\n\n")
            return response
        return web.json_response({
            "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": body.get("model"),
            "choices": [{"index": 0, "text": " a b c", "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                      "prompt_tokens_details": {"cached_tokens": 7}}, "kv_transfer_params": None})

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    scrapes = [0]

    async def metrics(request: web.Request) -> web.Response:
        scrapes[0] += 1  # this read included
        return web.Response(text=f'vllm:num_requests_running{{model_name="fake"}} 0.0\n'
                                 f'fake:metrics_scrapes_total {scrapes[0]}\n')

    async def release(request: web.Request) -> web.Response:
        record(request, await request.json())
        return web.json_response({"released": True})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/kv/release", release)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def main(args: argparse.Namespace) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    runner = web.AppRunner(make_app(args), access_log=None)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    print(json.dumps({"event": "ready", "port": sock.getsockname()[1], "pid": os.getpid()}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", required=True)
    parser.add_argument("--fail-status", type=int, default=0)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--engine-id", default="fake-engine")
    asyncio.run(main(parser.parse_args()))
