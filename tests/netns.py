"""Separate hosts on one machine: Linux network namespaces joined by a bridge, for tests.

Each `Host` is a network namespace with one veth link to a bridge that lives in a hub namespace of its own, and
one private address that exists only inside these namespaces: nothing is added to the root namespace. A process
started through `Host.wrap()` also gets its own PID namespace, because two processes that share a kernel and a
PID namespace are one host to UCX (it moves bytes by cross-memory attach, whatever the network says). The test
process reaches a host through `Host.call`, which runs a function on a thread that joined the host's network
namespace, so every socket it opens is opened there.

Namespace names carry the test process's PID, so parallel runs never clash; `Network.close` (also on a failed
setup) stops the client threads and deletes every namespace, which takes the veth links with it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

CLONE_NEWNET = 0x40000000
SUBNET = "10.213.0"  # exists only inside the namespaces made here
CLIENT_THREADS = 8

T = TypeVar("T")


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no `ip`, no `unshare`, or the kernel refused)."""


def ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise NamespacesUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def _join(netns_path: str) -> None:
    """Move the calling thread (only it) into the network namespace at `netns_path`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(netns_path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {netns_path}: {os.strerror(errno)}")
    finally:
        os.close(fd)


@dataclass
class Host:
    name: str  # the namespace's name
    address: str
    link: str  # the host's end of its veth pair (inside its namespace)
    clients: ThreadPoolExecutor

    def wrap(self, own_pids: bool = True) -> list[str]:
        """The command prefix that runs a process on this host (with its own PID namespace)."""
        prefix = ["ip", "netns", "exec", self.name]
        return prefix + ["unshare", "--pid", "--fork", "--kill-child"] if own_pids else prefix

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run `fn` on a thread inside this host's network namespace."""
        return self.clients.submit(fn, *args, **kwargs)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self.submit(fn, *args, **kwargs).result()

    def set_link(self, up: bool) -> None:
        """Plug or unplug this host's cable (its end of the veth pair)."""
        ip("-n", self.name, "link", "set", self.link, "up" if up else "down")


class Network:
    """Hosts on one bridge. Use as a context manager; everything made is removed on exit."""

    def __init__(self, *names: str) -> None:
        if os.geteuid() != 0:
            raise NamespacesUnavailable("network namespaces need root")
        for tool in ("ip", "unshare"):
            if shutil.which(tool) is None:
                raise NamespacesUnavailable(f"`{tool}` is not installed")
        self.prefix = f"pdt{os.getpid()}"
        self.hub = f"{self.prefix}-hub"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        try:
            self._add_namespace(self.hub)
            ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            ip("-n", self.hub, "link", "set", "br0", "up")
            for i, name in enumerate(names):
                self._add_host(name, f"{SUBNET}.{i + 2}", i)
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, netns: str) -> None:
        ip("netns", "add", netns)
        self._made.append(netns)
        ip("-n", netns, "link", "set", "lo", "up")

    def _add_host(self, name: str, address: str, index: int) -> None:
        netns = f"{self.prefix}-{name}"
        self._add_namespace(netns)
        port = f"port{index}"
        ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
        ip("-n", self.hub, "link", "set", port, "master", "br0", "up")
        ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", netns, "link", "set", "eth0", "up")
        clients = ThreadPoolExecutor(CLIENT_THREADS, thread_name_prefix=f"netns-{name}", initializer=_join,
                                     initargs=(f"/var/run/netns/{netns}",))
        self.hosts[name] = Host(netns, address, "eth0", clients)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the client threads (they hold their namespaces) and delete every namespace made."""
        for host in self.hosts.values():
            host.clients.shutdown(wait=True, cancel_futures=True)
        for netns in reversed(self._made):
            subprocess.run(["ip", "netns", "delete", netns], capture_output=True, timeout=30)
        self._made.clear()


def leftovers(prefix: str) -> list[str]:
    """Namespaces and root-namespace links whose name starts with `prefix` (there should be none)."""
    found = []
    for command in (["ip", "netns", "list"], ["ip", "-o", "link"]):
        out = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
        found += [line for line in out.splitlines() if prefix in line]
    return found
