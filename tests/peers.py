"""Third-party routers (nobody here wrote them), installed on demand into their own venvs under .cache/peers."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

PEERS_DIR = Path(__file__).resolve().parent.parent / ".cache" / "peers"


def peer_binary(package: str, binary: str) -> Path:
    """Install `package` into .cache/peers/<package> once and return its console script; skip if impossible.

    In CI (CI=true) a failed install fails the test instead: the peer comparison must run there at least once.
    """
    venv = PEERS_DIR / package
    exe = venv / "bin" / binary
    if exe.exists():
        return exe
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", package], check=True, capture_output=True,
                       timeout=600)
    except (subprocess.SubprocessError, OSError) as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"cannot install {package}: {exc}")
    return exe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_low() -> int:
    """The first port the kernel hands out for a bind to port 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def reserved_port(handed_out: set[int] = set()) -> int:  # noqa: B006 - remembers ports this process handed out
    """A free port for a process that binds it only much later (vLLM imports for 20 s before binding its side
    channel): taken below the ephemeral range, so no bind to port 0 by anything started meanwhile can take it,
    which is what a port from `free_port` suffered in a full run ("Address already in use")."""
    low = ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
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
