"""`pdserve serve MODEL_DIR`: flags named like `vllm serve`'s where the concept is the same."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import sys
from pathlib import Path

from pdserve.config import DEFAULT_KV_CACHE_GIB, ROLES, EngineConfig
from pdserve.net.body import DEFAULT_MAX_BODY_BYTES
from pdserve.net.listen import bind_socket, freeze_startup_objects, serve_announced

log = logging.getLogger("pdserve.serve")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", type=Path, help="Hugging Face model folder (config.json, *.safetensors, tokenizer)")
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--tokenizer", type=Path, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks-override", "--num-kv-blocks", dest="num_kv_blocks", type=int, default=None,
                   help="number of KV blocks (overrides --kv-cache-memory-gib)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=DEFAULT_KV_CACHE_GIB)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--role", choices=ROLES, default=None,
                   help="shorthand for the instance's role; --kv-transfer-config gives full control")
    p.add_argument("--kv-transfer-config", type=json.loads, default=None,
                   help='JSON like vLLM\'s: {"kv_connector": ..., "kv_role": "kv_producer"|"kv_consumer"|"kv_both", '
                        '"kv_connector_extra_config": {...}}')
    p.add_argument("--ec-transfer-config", type=json.loads, default=None,
                   help='JSON like vLLM\'s: {"ec_connector": "ECStorageConnector"|"ECP2PConnector", "ec_role": ..., '
                        '"ec_load_failure_policy": "recompute"|"fail", "ec_connector_extra_config": {...}}')
    p.add_argument("--encoder-cache-size", type=int, default=None, help="embeddings of encoder outputs to keep")
    p.add_argument("--allowed-local-media-path", type=Path, default=None,
                   help="a directory images may be read from by path (off by default)")
    p.add_argument("--allow-remote-media", action="store_true", help="fetch http(s) image URLs (off by default)")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over vLLM's OpenAI API")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed in the ready line)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds without progress before a request fails")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                   help="larger request bodies get 413 before they are read (default 32 MiB)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export request timelines as OpenTelemetry spans to this OTLP/HTTP collector "
                        "(needs pdserve[tracing]; off by default)")
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
        seed=args.seed, num_threads=args.threads, device=args.device, role=role, kv_transfer_config=kv_config,
        ec_transfer_config=args.ec_transfer_config or {}, encoder_cache_size=args.encoder_cache_size,
        allowed_local_media_path=args.allowed_local_media_path, allow_remote_media=args.allow_remote_media,
    )


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdserve.instance import Instance
    from pdserve.layers.linear import bound_onednn_caches

    bound_onednn_caches()
    config = engine_config_from_args(args)
    instance = Instance(config, request_timeout_s=args.request_timeout, otlp_traces_endpoint=args.otlp_traces_endpoint,
                        max_request_body_bytes=args.max_request_body_bytes)
    sock = bind_socket(args.host, args.port)
    asyncio.run(serve_app(instance, sock, args.log_level))
    return 0


async def serve_app(instance, sock: socket.socket, log_level: str = "info") -> None:
    app = await instance.start(advertised_host=sock.getsockname()[0])
    freeze_startup_objects()
    try:
        await serve_announced(app, sock, log_level, instance.ready_fields())
    finally:
        await instance.stop()
