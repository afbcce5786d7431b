"""`pdserve gateway`: flags, or a config file (TOML or JSON with the same keys), or both (flags win)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import sys
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from pdserve.gateway.call import Deadlines
from pdserve.gateway.forwarders import FORWARDERS
from pdserve.gateway.pairing import NoPairError
from pdserve.gateway.policies import POLICIES
from pdserve.gateway.service import Gateway, GatewayConfig
from pdserve.membership.cli import DISCOVERY_KEYS, add_discovery_flags
from pdserve.net.auth import AccessPolicy, resolve_admin_token
from pdserve.net.listen import bind_socket, freeze_startup_objects, serve_announced
from pdserve.startup import exit_on_startup_error

# The young generation's collection threshold while serving (CPython's default: 700). See _serve.
GC_YOUNG_THRESHOLD = 10_000
_DEADLINE_FLAGS = {"connect_timeout": "connect_s", "prefill_timeout": "prefill_s",
                   "first_token_timeout": "first_token_s", "idle_timeout": "idle_s"}
_HEALTH_FLAGS = {"health_check_interval": ("probe_interval_s", float, "seconds between health checks (default 1)"),
                 "health_check_timeout": ("health_timeout_s", float, "a slower /health failed, unless traffic to the "
                                                                     "instance succeeds meanwhile (default 2)"),
                 "breaker_failures": ("breaker_failures", int, "consecutive transport failures, timeouts or failed "
                                                               "health checks that stop traffic (default 3)"),
                 "breaker_open_seconds": ("breaker_open_s", float, "how long before a half-open health check may "
                                                                   "let traffic back (default 3)")}


def add_gateway_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("gateway", help="the OpenAI front door for a prefill/decode cluster",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", type=Path, help="TOML or JSON file with the same keys as the flags")
    p.add_argument("--prefill", nargs="+", default=None, metavar="URL")
    p.add_argument("--decode", nargs="+", default=None, metavar="URL")
    p.add_argument("--both", nargs="+", default=None, metavar="URL", help="colocated instances")
    p.add_argument("--encode", nargs="+", default=None, metavar="URL", help="encode instances (E→P→D for images)")
    p.add_argument("--protocol", default=None, help=f"one of: {', '.join(sorted(FORWARDERS))} (default pull)")
    p.add_argument("--scheduling", choices=["batch", "staged"], default=None)
    p.add_argument("--policy", default=None, help=f"one of: {', '.join(sorted([*POLICIES, 'kv_aware']))} "
                                                  "(default least_loaded)")
    p.add_argument("--retries", type=int, default=None, help="retries before the first byte (default 1)")
    p.add_argument("--conditional", action=argparse.BooleanOptionalAction, default=None,
                   help="send short prompts (or ones D already holds) to D alone")
    p.add_argument("--min-prompt-tokens", type=int, default=None)
    p.add_argument("--prefix-threshold", type=float, default=None)
    p.add_argument("--tokenizer", default=None,
                   help="the model's folder (its tokenizer and chat template) or a tokenizer.json: exact prompt lengths "
                        "for --conditional, and the token ids kv_aware routes by")
    _add_kv_routing_flags(p)
    p.add_argument("--allow-client-kv-params", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--max-request-body-bytes", type=int, default=None, metavar="BYTES",
                   help="larger request bodies get 413 before they are read (default 32 MiB)")
    for flag in _DEADLINE_FLAGS:
        p.add_argument(f"--{flag.replace('_', '-')}", type=float, default=None, metavar="SECONDS")
    for flag, (_, kind, text) in _HEALTH_FLAGS.items():
        p.add_argument(f"--{flag.replace('_', '-')}", type=kind, default=None, help=text)
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="clients must send 'Authorization: Bearer KEY' (default: $VLLM_API_KEY; /health and "
                        "/metrics stay open); also sent to instances unless --instance-api-key says otherwise")
    p.add_argument("--instance-api-key", default=None, metavar="KEY", help="the key the instances were started with")
    p.add_argument("--admin-token", default=None, metavar="TOKEN",
                   help="allow /register, /deregister and /admin/migrate with 'Authorization: Bearer TOKEN' "
                        "(default: $PDSERVE_ADMIN_TOKEN; with neither this nor --admin-port they are off)")
    p.add_argument("--admin-port", type=int, default=None, metavar="PORT",
                   help="serve the admin endpoints on 127.0.0.1:PORT (0 picks a free port)")
    add_discovery_flags(p)
    _add_rebalance_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"],
                   type=str.lower, help="log level")
    p.add_argument("--disable-log-requests", action="store_true", help="no access-log line per request")
    p.add_argument("--http-server", choices=["pdserve", "uvicorn"], default="pdserve",
                   help="the HTTP/1.1 server in front: pdserve's own (cheaper per request) or uvicorn's")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export request timelines as OpenTelemetry spans (needs pdserve[tracing])")
    return p


def _add_kv_routing_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-events", nargs="+", default=None, metavar="URL=ENDPOINT[,REPLAY]",
                   help="where an instance named by these flags publishes KV events, for kv_aware: its membership "
                        "record's kv_events (vLLM started with --kv-events-config; pdserve instances say it "
                        "themselves), e.g. http://h:8000=tcp://h:5557,tcp://h:5558")
    p.add_argument("--kv-overlap-weight", type=float, default=None,
                   help="kv_aware: weight of prompt tokens an instance does not hold against the tokens it is busy "
                        "with (default 2; 0 routes by load alone)")
    p.add_argument("--kv-store-hit-weight", type=float, default=None,
                   help="kv_aware: credit of a block held in an offload tier or store, against 1 for the device cache "
                        "(default 0.75)")
    p.add_argument("--kv-index-capacity", type=int, default=None,
                   help="kv_aware: entries (instance x block) the prefix index keeps, least recently stored dropped "
                        "first (default 1000000)")


def _add_rebalance_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rebalance", action=argparse.BooleanOptionalAction, default=None,
                   help="move running requests off a decode instance whose KV use or queue exceeds another's")
    p.add_argument("--rebalance-margin", type=float, default=None, metavar="FRACTION",
                   help="KV use (a fraction of the cache) by which one must exceed the other (default 0.2)")
    p.add_argument("--rebalance-queue-margin", type=float, default=None, metavar="REQUESTS",
                   help="or waiting requests by which one must exceed the other (default 2)")
    p.add_argument("--rebalance-max-mib-per-s", type=float, default=None, metavar="MIB_PER_S",
                   help="the pace of a rebalancing move's KV copy, sparing both instances' other requests (default "
                        "32; 0: unpaced)")


def load_config(args: argparse.Namespace) -> GatewayConfig:
    values: dict[str, Any] = {}
    if args.config is not None:
        text = args.config.read_text()
        values = json.loads(text) if args.config.suffix == ".json" else tomllib.loads(text)
    for name in ("prefill", "decode", "both", "encode", "protocol", "scheduling", "policy", "retries", "conditional",
                 "min_prompt_tokens", "prefix_threshold", "tokenizer", "allow_client_kv_params", "otlp_traces_endpoint",
                 "kv_events", "kv_overlap_weight", "kv_store_hit_weight", "kv_index_capacity",
                 "api_key", "instance_api_key", "admin_token", "admin_port", "max_request_body_bytes",
                 "rebalance", "rebalance_margin", "rebalance_queue_margin", "rebalance_max_mib_per_s",
                 *DISCOVERY_KEYS):
        value = getattr(args, name)
        if value is not None:
            values[name] = value
    for flag, (field_name, _, _) in _HEALTH_FLAGS.items():
        if getattr(args, flag) is not None:
            values[field_name] = getattr(args, flag)
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
    return exit_on_startup_error("pdserve gateway", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    config = load_config(args)
    gateway = Gateway(config)
    sock = bind_socket(args.host, args.port)
    admin_sock = None if config.admin_port is None else bind_socket("127.0.0.1", config.admin_port)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(_serve(gateway, sock, admin_sock, args.log_level, not args.disable_log_requests,
                              args.http_server))


async def _serve(gateway: Gateway, sock: Any, admin_sock: Any, log_level: str, log_requests: bool,
                 http: str) -> int:
    from pdserve.gateway.admin import ADMIN_PATHS
    from pdserve.gateway.app import build_app

    access = AccessPolicy(gateway.api_keys, resolve_admin_token(gateway.config.admin_token),
                          admin_sock.getsockname()[1] if admin_sock is not None else None, ADMIN_PATHS)
    try:
        await gateway.start()
    except NoPairError as exc:
        print(f"pdserve gateway: {exc}", file=sys.stderr)
        await gateway.stop()
        return 2
    freeze_startup_objects()
    # A proxied request holds a few dozen container objects while in flight, freed by their reference counts when it
    # ends; at the default threshold the swings of 32 requests in flight ran a young collection every ~40 requests,
    # each walking every in-flight request's objects. Measured at c=32 (gc.callbacks, 2026-11-28): 9 µs of
    # collection per request at 700, 2.5 µs at 10,000, with no more garbage found either way (docs/decisions.md).
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    try:
        await serve_announced(build_app(gateway, access, log_requests), sock, log_level, {
            "role": "gateway", "protocol": gateway.config.protocol, "scheduling": gateway.config.scheduling},
            admin_sock, proxy_headers=False, http=http)
    finally:
        await gateway.stop()
    return 0
