"""IP addresses as peers name them, for the checks of where an instance may point (admin registration, KV peers).

An IPv4 address written as IPv6 (`::ffff:169.254.169.254`) is the IPv4 address, and a zone (`fe80::1%eth0`)
does not change which address it is: a check that missed either could be walked around.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_address(text: str) -> Address | None:
    """The address `text` spells (brackets and zone allowed), or None when it is a host name."""
    try:
        ip = ipaddress.ip_address(text.strip("[]").split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


async def resolve(host: str, port: int | None = None) -> set[Address]:
    """Every address `host` resolves to, without blocking the event loop; OSError when it does not resolve."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except UnicodeError as exc:  # a name the IDNA codec refuses resolves to nothing
        raise OSError(f"invalid host name: {exc}") from exc
    return {ip for info in infos if (ip := parse_address(str(info[4][0]))) is not None}
