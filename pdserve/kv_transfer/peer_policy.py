"""Which instances this one may dial: `kv_connector_extra_config.allowed_peers`, checked before any connection.

A decode instance is told where the KV is by the request's own kv_transfer_params, so without a check anybody
who can reach it could make it connect anywhere. Entries are networks (CIDR, or a bare address) and host names.
By default: loopback and the private ranges, as instance ports and side channels belong on a private network.
Link-local addresses (169.254/16, fe80::/10, where cloud metadata services live) are allowed only by an entry
that is itself link-local, never by a wider one. A host name is allowed if listed, or if every address it
resolves to is.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.net.addresses import Address, parse_address, resolve

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_ALLOWED_PEERS = ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
_LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))


class PeerNotAllowed(ValueError):
    """The peer is outside kv_connector_extra_config.allowed_peers: nothing was dialled."""


def _link_local(net: Network) -> bool:
    return any(net.version == ll.version and net.subnet_of(ll) for ll in _LINK_LOCAL)


@dataclass(frozen=True, slots=True)
class PeerPolicy:
    networks: tuple[Network, ...]
    names: frozenset[str]

    @classmethod
    def from_config(cls, entries: Iterable[str] | None) -> PeerPolicy:
        if entries is None:
            entries = DEFAULT_ALLOWED_PEERS
        if isinstance(entries, str) or not all(isinstance(e, str) and e for e in entries):
            raise ValueError("kv_connector_extra_config.allowed_peers must be a list of CIDRs or host names")
        networks, names = [], set()
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                names.add(entry.lower().rstrip("."))
        return cls(tuple(networks), frozenset(names))

    def allows_address(self, ip: Address) -> bool:
        for net in self.networks:
            if net.version == ip.version and ip in net and (not ip.is_link_local or _link_local(net)):
                return True
        return False

    async def check(self, host: str) -> None:
        """Raises PeerNotAllowed unless `host` may be dialled; resolves an unlisted name (without blocking)."""
        ip = parse_address(host)
        if ip is not None:
            if not self.allows_address(ip):
                raise PeerNotAllowed(f"{host} is not an allowed KV peer (kv_connector_extra_config.allowed_peers)")
            return
        if host.lower().rstrip(".") in self.names:
            return
        try:
            resolved = await resolve(host)
        except OSError as exc:
            raise PeerNotAllowed(f"KV peer {host} does not resolve: {exc}") from exc
        if not resolved or not all(self.allows_address(ip) for ip in resolved):
            raise PeerNotAllowed(f"{host} resolves outside the allowed KV peers (kv_connector_extra_config."
                                 f"allowed_peers)")
