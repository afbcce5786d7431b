"""Real KV stores for tests and benchmarks, on loopback and ephemeral ports, stopped by PID.

* Redis: Debian's `redis-server` (installed by `make install`), no persistence, `maxmemory` with `allkeys-lru`
  so a full store evicts as a deployed cache would.
* Mooncake Store: the `mooncake_master` binary from Mooncake's wheel (metadata only) and one `mooncake_client`
  process holding the global segment (the objects), as Mooncake is deployed: instances mount no memory of their
  own, so a restarted instance finds the store as it left it.

`kill()` ends the server as a crash would (SIGKILL); `start()` brings it back on the same ports (a Mooncake master
that restarts has forgotten every object).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from peers import reserved_port, stop


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} not listening on {port} after {timeout} s")


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "GLOG_minloglevel": "1"}  # Mooncake logs every call at INFO
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


@dataclass
class StoreServer:
    kind: str  # "redis" | "mooncake"
    workdir: Path
    size: str  # Redis's maxmemory, or the Mooncake segment's size
    ports: dict[str, int] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def url(self) -> str:
        if self.kind == "redis":
            return f"redis://127.0.0.1:{self.ports['redis']}/0"
        return f"mooncake://127.0.0.1:{self.ports['master']}"

    def start(self) -> StoreServer:
        for name in ("redis",) if self.kind == "redis" else ("master", "client", "metrics"):
            self.ports.setdefault(name, reserved_port())
        if self.kind == "redis":
            self._start_redis()
        else:
            self._start_mooncake()
        return self

    def _start_redis(self) -> None:
        port = self.ports["redis"]
        proc = _spawn(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                       "--dir", str(self.workdir), "--maxmemory", self.size, "--maxmemory-policy", "allkeys-lru",
                       "--protected-mode", "no"], self.workdir / "redis.log")
        self.procs.append(proc)
        _wait_port(port, proc, "redis-server")

    def _start_mooncake(self) -> None:
        import mooncake

        binaries = Path(mooncake.__file__).parent
        p = self.ports
        master = _spawn([str(binaries / "mooncake_master"), f"-rpc_port={p['master']}", "-rpc_address=127.0.0.1",
                         f"-metrics_port={p['metrics']}", "-enable_metric_reporting=false"],
                        self.workdir / "master.log")
        self.procs.append(master)
        _wait_port(p["master"], master, "mooncake_master")
        holder = _spawn([str(binaries / "mooncake_client"), f"-master_server_address=127.0.0.1:{p['master']}",
                         "-metadata_server=P2PHANDSHAKE", f"-global_segment_size={self.size}", f"-port={p['client']}",
                         "-host=127.0.0.1"], self.workdir / "client.log")
        self.procs.append(holder)
        _wait_port(p["client"], holder, "mooncake_client")

    def kill(self) -> None:
        """Every process of the store, as a crash would end it."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self.procs.clear()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)
        self.procs.clear()


def store_server(kind: str, workdir: Path, size: str) -> StoreServer:
    """A started store of `kind`; skips when its server is not installed (fails under CI=true)."""
    missing = kind == "redis" and shutil.which("redis-server") is None
    if kind == "mooncake":
        try:
            import mooncake.store  # noqa: F401
        except ImportError:
            missing = True
    if missing:
        if os.environ.get("CI") == "true":
            raise RuntimeError(f"the {kind} store is not installed (make install installs it)")
        pytest.skip(f"the {kind} store is not installed (make install installs it)")
    workdir.mkdir(parents=True, exist_ok=True)
    return StoreServer(kind, workdir, size).start()
