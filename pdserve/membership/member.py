"""An instance's side of membership: its registration (when `--discovery` names a store) and its drain."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.membership.drain import Drain, DrainGuard, DrainState, HandOff, wait_to_finish
from pdserve.membership.record import MemberRecord, RecordError, normalise_url
from pdserve.membership.registrar import DEFAULT_TTL_S, Registrar
from pdserve.membership.url import parse_discovery

log = logging.getLogger(__name__)
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def add_member_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--discovery", default=None, metavar="URL",
                   help="register in the fleet's store: etcd://HOST:PORT[,HOST:PORT...]/PREFIX (a lease, kept alive; "
                        "revoked on the way out)")
    p.add_argument("--advertise-url", default=None, metavar="URL",
                   help="how gateways reach this instance (default: http://HOST:PORT it listens on)")
    p.add_argument("--discovery-ttl", type=int, default=DEFAULT_TTL_S, metavar="SECONDS",
                   help="the registration's lease: a crashed instance leaves within this")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="SECONDS",
                   help="on SIGTERM or POST /admin/drain: how long running requests get to finish")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                   help="a label for the membership record (repeatable)")


def parse_labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--label {item!r}: expected KEY=VALUE")
        labels[key] = value
    return labels


def advertised_url(flag: str | None, host: str, port: int, registering: bool = True) -> str:
    """How gateways reach this instance: `--advertise-url`, else the address it listens on (which must then be
    one address, when the instance registers itself)."""
    if flag is None and host in ("0.0.0.0", "::", ""):
        if registering:
            raise ValueError(f"listening on {host or 'every address'}: say how gateways reach this instance with "
                             "--advertise-url http://HOST:PORT")
        host = "127.0.0.1"  # unused: nothing registers it
    try:
        return normalise_url(flag or f"http://{host if ':' not in host else f'[{host}]'}:{port}")
    except RecordError as exc:
        raise ValueError(f"--advertise-url: {exc}") from None


@dataclass
class MemberOptions:
    discovery: str | None = None
    advertise_url: str | None = None
    ttl_s: int = DEFAULT_TTL_S
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MemberOptions:
        """Raises ValueError (a startup error) for flags that cannot work."""
        if args.discovery is not None:
            spec = parse_discovery(args.discovery)
            if spec.kind != "etcd":
                raise ValueError(f"--discovery {args.discovery!r}: an instance registers itself in etcd only (in "
                                 "Kubernetes the gateway reads pods; elsewhere give the gateway its URL)")
        if args.drain_timeout < 0:
            raise ValueError("--drain-timeout must not be negative")
        return cls(args.discovery, args.advertise_url, args.discovery_ttl, args.drain_timeout,
                   parse_labels(args.label))


class InstanceMember:
    """Registration and drain of one instance; `record()` says what it is now. `hand_off` is the drain's third
    step: by default the running requests finish here; a decode instance may move them elsewhere instead."""

    def __init__(self, options: MemberOptions, record: Callable[[], MemberRecord], state: DrainState,
                 hand_off: HandOff = wait_to_finish) -> None:
        self.registrar: Registrar | None = None
        if options.discovery is not None:
            from pdserve.membership.etcd_client import EtcdClient

            spec = parse_discovery(options.discovery)
            self.registrar = Registrar(EtcdClient(list(spec.endpoints)), spec.prefix, record, options.ttl_s)
        self.drain = Drain(state, options.drain_timeout_s, self._leave if self.registrar else None, hand_off)

    def wrap(self, app: Any) -> DrainGuard:
        return DrainGuard(app, self.drain)

    def drain_hook(self, stop: Callable[[], None]) -> Callable[[], None]:
        """For serve_announced: the drain stops the server when it is done; SIGTERM starts it."""
        self.drain.on_done = stop
        return self.drain.start

    def start(self) -> None:
        if self.registrar is not None:
            self.registrar.start()

    async def _leave(self) -> None:
        await self.registrar.leave()

    async def stop(self) -> None:
        """On the way out, drained or not: the registration ends before the process does."""
        if self.registrar is not None:
            await self.registrar.leave()
            await self.registrar.close()
