"""A fake vLLM instance (a test double, named as one): records every request and answers in vLLM's shapes.

It answers a prefill leg the way vLLM's NIXL producer does (one token, top-level kv_transfer_params) and any
other completion with a short answer (JSON, or SSE when asked to stream). It can be told to fail every POST
with a status, to hang on POSTs, or to admit a stream and die before its first token, so gateway behaviour under failures can be tested; to answer one prompt with
a 500 and then close the connection (what uvicorn does after an unhandled exception in the app); to answer
/health late while serving everything else at once (a busy vLLM's event loop; also switchable at run time with
`POST /fake/health-delay {"seconds": S}`); and to listen on a given port, so that a killed fake can be
restarted at the same address.

It describes itself the way vLLM 0.32 with the NixlConnector does (/version, `vllm:nixl_` metrics, a 404 for a KV
release), or, with `--kind pdserve`, as a pdserve decode instance (/v1/pdserve/info), so a failing decode leg can
be paired with a real pdserve prefill instance.

    python tests/fake_vllm.py --record FILE [--fail-status 503] [--hang] [--engine-id ID] [--kind vllm|pdserve]
                              [--poison PROMPT] [--health-delay SECONDS] [--port PORT]
                              [--die-after-headers] [--refuse-kv-params]
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
        if args.poison is not None and body.get("prompt") == args.poison:
            return await _answer_then_close(request)
        if args.fail_status:
            await asyncio.sleep(args.fail_delay)
            return web.json_response({"error": {"message": "injected failure", "type": "InternalServerError",
                                                "code": args.fail_status}}, status=args.fail_status)
        counter["n"] += 1
        params = body.get("kv_transfer_params") or {}
        if args.refuse_kv_params and params.get("do_remote_prefill"):  # a D that cannot read what P handed out
            return web.json_response({"error": {"message": "kv_transfer_params.remote_request_id must be a non-empty "
                                                "string", "type": "BadRequestError", "param": "kv_transfer_params",
                                                "code": 400}}, status=400)
        if params.get("do_remote_decode") and args.prefill_answers_a_list:  # 200, but no completion object
            return web.json_response([{"kv_transfer_params": None}])
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
            if args.die_after_headers:  # a D that admitted the request and died while loading P's KV
                request.transport.close()
                return response
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
        await asyncio.sleep(args.health_delay)
        return web.Response(status=200)

    async def set_health_delay(request: web.Request) -> web.Response:
        args.health_delay = float((await request.json())["seconds"])
        return web.json_response({"health_delay": args.health_delay})

    scrapes = [0]

    async def metrics(request: web.Request) -> web.Response:
        scrapes[0] += 1  # this read included
        return web.Response(text=f'vllm:num_requests_running{{model_name="fake"}} 0.0\n'
                                 f'vllm:nixl_num_failed_transfers_total{{model_name="fake"}} 0.0\n'
                                 f'fake:metrics_scrapes_total {scrapes[0]}\n')

    async def release(request: web.Request) -> web.Response:
        record(request, await request.json())
        if args.kind == "vllm":  # vLLM has no such route
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response({"released": True})

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def info(request: web.Request) -> web.Response:
        if args.kind != "pdserve":
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response({"version": 1, "engine": "pdserve", "engine_version": "fake", "role": "decode",
                                  "kv_connector": "PdConnector", "data_planes": ["tcp"],
                                  "protocols": ["pull", "push", "decode-first"]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/kv/release", release)
    app.router.add_get("/health", health)
    app.router.add_post("/fake/health-delay", set_health_delay)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/pdserve/info", info)
    return app


async def _answer_then_close(request: web.Request) -> web.StreamResponse:
    """A whole keep-alive answer, then the connection closed under it: a client that reuses the connection at
    once finds it dead although the server is fine."""
    response = web.json_response({"error": {"message": "poisoned prompt", "type": "InternalServerError",
                                            "param": None, "code": 500}}, status=500)
    await response.prepare(request)
    await response.write_eof()
    request.transport.close()
    return response


async def main(args: argparse.Namespace) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
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
    parser.add_argument("--fail-delay", type=float, default=0.0, help="seconds before --fail-status answers")
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--die-after-headers", action="store_true")
    parser.add_argument("--engine-id", default="fake-engine")
    parser.add_argument("--kind", choices=["vllm", "pdserve"], default="vllm")
    parser.add_argument("--poison", default=None)
    parser.add_argument("--refuse-kv-params", action="store_true", help="answer 400 to a decode with P's params")
    parser.add_argument("--health-delay", type=float, default=0.0)
    parser.add_argument("--prefill-answers-a-list", action="store_true", help="a prefill answered 200 with [...]")
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(main(parser.parse_args()))
