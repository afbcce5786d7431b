"""`pdserve gateway`: flags, or a config file (TOML or JSON with the same keys), or both (flags win)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from pdserve.gateway.call import Deadlines
from pdserve.gateway.forwarders import FORWARDERS
from pdserve.gateway.policies import POLICIES
from pdserve.gateway.service import Gateway, GatewayConfig
from pdserve.net.listen import bind_socket, freeze_startup_objects, serve_announced

_DEADLINE_FLAGS = {"connect_timeout": "connect_s", "prefill_timeout": "prefill_s",
                   "first_token_timeout": "first_token_s", "idle_timeout": "idle_s"}


def add_gateway_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("gateway", help="the OpenAI front door for a prefill/decode cluster")
    p.add_argument("--config", type=Path, help="TOML or JSON file with the same keys as the flags")
    p.add_argument("--prefill", nargs="+", default=None, metavar="URL")
    p.add_argument("--decode", nargs="+", default=None, metavar="URL")
    p.add_argument("--both", nargs="+", default=None, metavar="URL", help="colocated instances")
    p.add_argument("--encode", nargs="+", default=None, metavar="URL", help="encode instances (E→P→D for images)")
    p.add_argument("--protocol", default=None, help=f"one of: {', '.join(sorted(FORWARDERS))} (default pull)")
    p.add_argument("--scheduling", choices=["batch", "staged"], default=None)
    p.add_argument("--policy", default=None, help=f"one of: {', '.join(sorted(POLICIES))} (default least_loaded)")
    p.add_argument("--retries", type=int, default=None, help="retries before the first byte (default 1)")
    p.add_argument("--conditional", action=argparse.BooleanOptionalAction, default=None,
                   help="send short prompts (or ones D already holds) to D alone")
    p.add_argument("--min-prompt-tokens", type=int, default=None)
    p.add_argument("--prefix-threshold", type=float, default=None)
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, for exact prompt lengths")
    p.add_argument("--allow-client-kv-params", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--max-request-body-bytes", type=int, default=None, metavar="BYTES",
                   help="larger request bodies get 413 before they are read (default 32 MiB)")
    for flag in _DEADLINE_FLAGS:
        p.add_argument(f"--{flag.replace('_', '-')}", type=float, default=None, metavar="SECONDS")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export request timelines as OpenTelemetry spans (needs pdserve[tracing])")
    return p


def load_config(args: argparse.Namespace) -> GatewayConfig:
    values: dict[str, Any] = {}
    if args.config is not None:
        text = args.config.read_text()
        values = json.loads(text) if args.config.suffix == ".json" else tomllib.loads(text)
    for name in ("prefill", "decode", "both", "encode", "protocol", "scheduling", "policy", "retries", "conditional",
                 "min_prompt_tokens", "prefix_threshold", "tokenizer", "allow_client_kv_params", "otlp_traces_endpoint",
                 "max_request_body_bytes"):
        value = getattr(args, name)
        if value is not None:
            values[name] = value
    deadlines = dict(values.pop("deadlines", {}) or {})
    for flag, field_name in _DEADLINE_FLAGS.items():
        if getattr(args, flag) is not None:
            deadlines[field_name] = getattr(args, flag)
    known = {f.name for f in fields(GatewayConfig)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown gateway config keys {sorted(unknown)}; known: {sorted(known - {'deadlines'})}")
    return GatewayConfig(**values, deadlines=Deadlines(**deadlines))


def run_gateway(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args)
        gateway = Gateway(config)
    except ValueError as exc:
        print(f"pdserve gateway: {exc}", file=sys.stderr)
        return 2
    sock = bind_socket(args.host, args.port)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(gateway, sock, args.log_level))
    return 0


async def _serve(gateway: Gateway, sock: Any, log_level: str) -> None:
    from pdserve.gateway.app import build_app

    await gateway.start()
    freeze_startup_objects()
    try:
        await serve_announced(build_app(gateway), sock, log_level, {
            "role": "gateway", "protocol": gateway.config.protocol, "scheduling": gateway.config.scheduling})
    finally:
        await gateway.stop()
