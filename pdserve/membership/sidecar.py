"""`pdserve register`: holds an etcd registration for an instance that cannot register itself (vLLM).

It registers the instance only once it can describe itself (its `/health` answers 200 and it names its model),
keeps the lease alive while `/health` keeps answering, and gives it up (state `not_ready`, then the lease is
revoked) after `--unhealthy-after` failed checks in a row; it registers again when the instance is back. On
SIGTERM or SIGINT it leaves (state `draining`) and exits 0. A crashed sidecar's lease expires within its TTL.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from urllib.parse import urlsplit

from pdserve.membership.etcd_client import EtcdClient
from pdserve.membership.identity import served_model
from pdserve.membership.member import parse_labels
from pdserve.membership.record import NOT_READY, ROLES, MemberRecord, check_record, kv_events_from_vllm
from pdserve.membership.registrar import DEFAULT_TTL_S, Registrar
from pdserve.membership.url import parse_discovery
from pdserve.net.auth import bearer_header
from pdserve.net.http_client import HttpPool, UpstreamError, UpstreamTimeout
from pdserve.net.listen import announce_ready
from pdserve.server.info import INFO_PATH, InstanceInfo, decode_info
from pdserve.startup import exit_on_startup_error

log = logging.getLogger(__name__)


def add_register_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("register", help="hold an etcd registration for an instance (a sidecar for vLLM)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--discovery", required=True, metavar="URL", help="etcd://HOST:PORT[,HOST:PORT...]/PREFIX")
    p.add_argument("--url", required=True, help="how gateways reach the instance: http://HOST:PORT")
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--model", default=None, help="the served model name (default: the first in its /v1/models)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="the instance's vLLM --kv-events-config, so KV-event subscribers learn where it publishes")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--discovery-ttl", type=int, default=DEFAULT_TTL_S, metavar="SECONDS")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS")
    p.add_argument("--health-timeout", type=float, default=2.0, metavar="SECONDS")
    p.add_argument("--unhealthy-after", type=int, default=2, metavar="N",
                   help="failed health checks in a row that end the registration")
    p.add_argument("--api-key", default=None, help="the instance's API key, if it has one (for /v1/models)")
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=["debug", "info", "warning", "error", "critical"])
    return p


def run_register(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return exit_on_startup_error("pdserve register", lambda: _start(args))


def _start(args: argparse.Namespace) -> int:
    spec = parse_discovery(args.discovery)
    if spec.kind != "etcd":
        raise ValueError(f"--discovery {args.discovery!r}: pdserve register writes to etcd only")
    if args.discovery_ttl < 1 or args.health_interval <= 0 or args.health_timeout <= 0 or args.unhealthy_after < 1:
        raise ValueError("--discovery-ttl, --health-interval, --health-timeout and --unhealthy-after must be positive")
    base = check_record(MemberRecord(url=args.url, role=args.role, model=args.model, labels=parse_labels(args.label),
                                     kv_events=kv_events_from_vllm(args.kv_events_config), source="sidecar"))
    sidecar = Sidecar(base, EtcdClient(list(spec.endpoints)), spec.prefix, args)
    return asyncio.run(sidecar.run())


class Sidecar:
    def __init__(self, base: MemberRecord, client: EtcdClient, prefix: str, args: argparse.Namespace) -> None:
        parts = urlsplit(base.url)
        self.pool = HttpPool(parts.hostname, parts.port, headers=bearer_header(args.api_key))
        self.base = base
        self.record = base
        self.args = args
        self.registrar = Registrar(client, prefix, lambda: self.record, args.discovery_ttl)
        self.registered = False

    async def run(self) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        announce_ready(role="register", url=self.base.url)
        watcher = asyncio.create_task(self._watch())
        await stop.wait()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await self.registrar.leave()
        await self.registrar.close()
        self.pool.close()
        return 0

    async def _watch(self) -> None:
        failures = 0
        while True:
            ok = await self._healthy()
            failures = 0 if ok else failures + 1
            if ok and not self.registered:
                await self._register()
            elif self.registered and failures >= self.args.unhealthy_after:
                log.warning("instance %s failed %d health checks in a row; leaving the fleet", self.base.url,
                            failures)
                await self.registrar.leave(NOT_READY)
                self.registered = False
            await asyncio.sleep(self.args.health_interval)

    async def _healthy(self) -> bool:
        try:
            async with asyncio.timeout(self.args.health_timeout):
                response = await self.pool.request("GET", "/health", connect_timeout=self.args.health_timeout)
                await response.read()
        except (TimeoutError, UpstreamError, UpstreamTimeout, OSError):
            return False
        return response.status == 200

    async def _register(self) -> None:
        """Only an instance that names its model is registered (one that cannot yet is asked again)."""
        model = self.base.model or await served_model(self.pool)
        if model is None:
            log.info("instance %s answers /health but lists no model yet; waiting", self.base.url)
            return
        self.record = MemberRecord(**{**{f: getattr(self.base, f) for f in self.base.__struct_fields__},
                                      "model": model, "info": await self._info()})
        self.registrar.start()
        self.registered = True

    async def _info(self) -> InstanceInfo | None:
        """A pdserve instance's /v1/pdserve/info (vLLM has none)."""
        try:
            response = await self.pool.request("GET", INFO_PATH, connect_timeout=1.0, header_timeout=2.0)
            body = await response.read(timeout=2.0)
            return decode_info(body) if response.status == 200 else None
        except (UpstreamError, UpstreamTimeout, OSError, ValueError):
            return None
