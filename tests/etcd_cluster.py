"""A real etcd (Debian's `etcd-server`) on loopback, one member or three, for tests and benchmarks.

Each member gets ports of its own from the kernel (bound and released just before etcd binds them), its data
in the caller's folder, and is stopped by PID. A member can be killed, started again with its data (it rejoins),
or wiped, to drive quorum loss and recovery.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from peers import reserved_port
from server_utils import wait_for

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def available() -> bool:
    return os.access(ETCD, os.X_OK)


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class EtcdCluster:
    root: Path
    size: int = 1
    members: list[Member] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for i in range(self.size):
            self.members.append(Member(f"m{i}", reserved_port(), reserved_port(), self.root / f"m{i}",
                                       self.root / f"m{i}.log"))

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def url(self, prefix: str = "/pdserve") -> str:
        return f"etcd://{self.endpoints}{prefix}"

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        for member in self.members:
            self.start_member(member, wait=False)
        self.wait_healthy(timeout)
        return self

    def start_member(self, member: Member, wait: bool = True) -> None:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        argv = [ETCD, "--name", member.name, "--data-dir", str(member.data_dir),
                "--listen-client-urls", f"http://{member.endpoint}", "--advertise-client-urls",
                f"http://{member.endpoint}", "--listen-peer-urls", member.peer_url,
                "--initial-advertise-peer-urls", member.peer_url, "--initial-cluster", initial,
                "--initial-cluster-state", "new", "--initial-cluster-token", f"pdserve-{id(self)}",
                # Small heartbeats so a three-member cluster elects a leader quickly on a loaded box.
                "--heartbeat-interval", "100", "--election-timeout", "1000", "--log-level", "warn"]
        with member.log_path.open("ab") as log:
            member.proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
        if wait:
            wait_for(lambda: _healthy(member), 30.0, f"etcd member {member.name}")

    def wait_healthy(self, timeout: float = 30.0) -> None:
        wait_for(lambda: all(_healthy(m) for m in self.members if m.alive()), timeout, "etcd cluster health")

    def wipe(self) -> None:
        """Every member stopped, its data gone, and a new cluster started on the same ports: an etcd restored
        from nothing."""
        self.stop()
        for member in self.members:
            shutil.rmtree(member.data_dir, ignore_errors=True)
        self.start()

    def stop(self) -> None:
        for member in self.members:
            member.stop()


def _healthy(member: Member) -> bool:
    if not member.alive():
        return False
    try:
        with urllib.request.urlopen(f"http://{member.endpoint}/health", timeout=1) as answer:
            return b'"true"' in answer.read()
    except OSError:
        return False

