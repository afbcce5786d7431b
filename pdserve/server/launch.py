"""`pdserve serve MODEL_DIR`: flags named like `vllm serve`'s where the concept is the same."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from pathlib import Path

from pdserve.config import ATTENTION_BACKENDS, DEFAULT_KV_CACHE_GIB, ROLES, EngineConfig
from pdserve.membership.member import MemberOptions, add_member_flags, advertised_url
from pdserve.net.auth import AccessGuard, AccessPolicy, resolve_admin_token, resolve_api_keys
from pdserve.net.body import DEFAULT_MAX_BODY_BYTES
from pdserve.net.listen import StartupError, bind_socket, freeze_startup_objects, serve_announced
from pdserve.startup import STARTUP_ERRORS, exit_on_startup_error, json_object

log = logging.getLogger("pdserve.serve")
# Fault injection (drills) and draining (rolling restarts): for operators, never for clients.
ADMIN_PATHS = frozenset({"/v1/kv/faults", "/admin/drain"})


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", type=Path, help="Hugging Face model folder (config.json, *.safetensors, tokenizer)")
    p.add_argument("--served-model-name", nargs="+", default=None, help="the name clients use (default: the path)")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder, if not the model's")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache dtype")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt plus output (default: the model's max_position_embeddings)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-gpu-blocks-override", "--num-kv-blocks", dest="num_kv_blocks", type=int, default=None,
                   help="number of KV blocks (overrides --kv-cache-memory-gib)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=DEFAULT_KV_CACHE_GIB, help="memory for the KV cache")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="most tokens computed in one step")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the KV of common prompt prefixes")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps")
    p.add_argument("--seed", type=int, default=0, help="seed of requests that bring none")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None,
                   help="decode attention: the native paged kernel (built by `make install`), plain torch, or auto "
                        "(native when built, else torch); default $PDSERVE_ATTENTION_BACKEND, else auto")
    p.add_argument("--role", choices=ROLES, default=None,
                   help="shorthand for the instance's role; --kv-transfer-config gives full control")
    p.add_argument("--kv-transfer-config", type=json_object, default=None,
                   help='JSON like vLLM\'s: {"kv_connector": ..., "kv_role": "kv_producer"|"kv_consumer"|"kv_both", '
                        '"kv_connector_extra_config": {...}}')
    p.add_argument("--ec-transfer-config", type=json_object, default=None,
                   help='JSON like vLLM\'s: {"ec_connector": "ECStorageConnector"|"ECP2PConnector", "ec_role": ..., '
                        '"ec_load_failure_policy": "recompute"|"fail", "ec_connector_extra_config": {...}}')
    p.add_argument("--kv-events-config", type=json_object, default=None,
                   help='JSON like vLLM\'s: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
                        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "...", "buffer_steps": 10000, '
                        '"hwm": 100000, "max_queue_size": 100000}; port 0 takes a free port on --host')
    p.add_argument("--encoder-cache-size", type=int, default=None, help="embeddings of encoder outputs to keep")
    p.add_argument("--allowed-local-media-path", type=Path, default=None,
                   help="a directory images may be read from by path (off by default)")
    p.add_argument("--allow-remote-media", action="store_true", help="fetch http(s) image URLs (off by default)")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over vLLM's OpenAI API",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed in the ready line)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds without progress before a request fails")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                   help="larger request bodies get 413 before they are read (default 32 MiB)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"],
                   type=str.lower, help="log level")
    p.add_argument("--disable-log-requests", action="store_true", help="no access-log line per request")
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="clients must send 'Authorization: Bearer KEY' (default: $VLLM_API_KEY); /health, /metrics "
                        "and /version stay open, as in vLLM")
    p.add_argument("--admin-token", default=None, metavar="TOKEN",
                   help="allow POST /v1/kv/faults with 'Authorization: Bearer TOKEN' (default: $PDSERVE_ADMIN_TOKEN)")
    p.add_argument("--admin-port", type=int, default=None, metavar="PORT",
                   help="serve POST /v1/kv/faults on 127.0.0.1:PORT (0 picks a free port)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export request timelines as OpenTelemetry spans to this OTLP/HTTP collector "
                        "(needs pdserve[tracing]; off by default)")
    add_member_flags(p)
    return p


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from pdserve.kv_transfer.config import resolve_transfer_config

    role, kv_config = resolve_transfer_config(args.role, args.kv_transfer_config)
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        tokenizer=args.tokenizer, dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gib=args.kv_cache_memory_gib,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
        seed=args.seed, num_threads=args.threads, device=args.device,
        attention_backend=args.attention_backend, role=role, kv_transfer_config=kv_config,
        ec_transfer_config=args.ec_transfer_config or {}, kv_events_config=args.kv_events_config or {},
        encoder_cache_size=args.encoder_cache_size,
        allowed_local_media_path=args.allowed_local_media_path, allow_remote_media=args.allow_remote_media,
    )


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return exit_on_startup_error("pdserve serve", lambda: _serve(args))


def _serve(args: argparse.Namespace) -> int:
    from pdserve.instance import Instance
    from pdserve.layers.linear import bound_onednn_caches

    bound_onednn_caches()
    member = MemberOptions.from_args(args)
    config = engine_config_from_args(args)
    if not config.model.is_dir():
        raise StartupError(f"model folder {config.model} does not exist")
    api_keys = resolve_api_keys(args.api_key)
    sock = bind_socket(args.host, args.port)  # before loading the model: a taken port fails in a second
    member.advertise_url = advertised_url(args.advertise_url, *sock.getsockname()[:2], member.discovery is not None)
    admin_sock = None if args.admin_port is None else bind_socket("127.0.0.1", args.admin_port)
    access = AccessPolicy(api_keys, resolve_admin_token(args.admin_token),
                          admin_sock.getsockname()[1] if admin_sock is not None else None, ADMIN_PATHS)
    instance = Instance(config, request_timeout_s=args.request_timeout, otlp_traces_endpoint=args.otlp_traces_endpoint,
                        log_requests=not args.disable_log_requests, api_key=api_keys[0] if api_keys else None,
                        max_request_body_bytes=args.max_request_body_bytes)
    asyncio.run(serve_app(instance, sock, args.log_level, access, admin_sock, member))
    return 0


async def serve_app(instance, sock: socket.socket, log_level: str = "info", access: AccessPolicy | None = None,
                    admin_sock: socket.socket | None = None, member: MemberOptions | None = None) -> None:
    try:
        app = await instance.start(advertised_host=sock.getsockname()[0])
    except STARTUP_ERRORS as exc:  # e.g. the side channel's port is taken
        raise StartupError(str(exc)) from exc
    membership = instance.member(member or MemberOptions(
        advertise_url=advertised_url(None, *sock.getsockname()[:2], registering=False)))
    membership.start()
    freeze_startup_objects()
    try:
        await serve_announced(AccessGuard(membership.wrap(app), access or AccessPolicy(admin_paths=ADMIN_PATHS)),
                              sock, log_level, instance.ready_fields(), admin_sock, membership.drain_hook)
    finally:
        await membership.stop()
        await instance.stop()
