"""Third-party routers (nobody here wrote them), installed on demand into their own venvs under .cache/peers."""

from __future__ import annotations

import fcntl
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

CACHE = Path(__file__).resolve().parent.parent / ".cache"
PEERS_DIR = CACHE / "peers"


@contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold .cache/<name>.lock: one install into .cache at a time, across pytest-xdist workers and parallel runs.
    A process that waited finds the install done (each installer checks its stamp first) and does nothing."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def peer_binary(package: str, binary: str) -> Path:
    """Install `package` into .cache/peers/<package> once and return its console script; skip if impossible.

    In CI (CI=true) a failed install fails the test instead: the peer comparison must run there at least once.
    """
    venv = PEERS_DIR / package
    exe = venv / "bin" / binary
    with cache_lock("peers"):
        if exe.exists():
            return exe
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
            subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", package], check=True,
                           capture_output=True, timeout=600)
        except (subprocess.SubprocessError, OSError) as exc:
            if os.environ.get("CI") == "true":
                raise
            pytest.skip(f"cannot install {package}: {exc}")
    return exe


def ephemeral_low() -> int:
    """The first port the kernel hands out for a bind to port 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


RESERVED_SPAN = 12000  # ports below the ephemeral range that reserved_port hands out


def worker_slice(low: int) -> range:
    """This pytest process's share of the reserved span: under pytest-xdist each worker (gw0, gw1, ...) draws from
    its own slice, so two workers can never hand out the same port before either process has bound it."""
    first = max(1024, low - RESERVED_SPAN)
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    width = (low - first) // count
    return range(first + index * width, first + (index + 1) * width)


def reserved_port(handed_out: set[int] = set()) -> int:  # noqa: B006 - remembers ports this process handed out
    """A free port for a process that binds it only later (vLLM imports for 20 s before binding its side channel,
    a restarted server binds its old port again): taken below the ephemeral range, so no bind to port 0 by
    anything started meanwhile can take it (a port bound to 0 and freed was taken so in a full run: "Address
    already in use"), and from this worker's own slice of that range (`worker_slice`)."""
    ports = worker_slice(ephemeral_low())
    for _ in range(200):
        port = random.choice(ports)
        if port in handed_out:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        handed_out.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
