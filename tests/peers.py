"""Third-party routers (nobody here wrote them), installed on demand into their own venvs under .cache/peers."""

from __future__ import annotations

import os
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
