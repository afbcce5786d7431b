"""The suite's fork servers (pdserve/forkserver.py): one for `python -m pdserve` processes and, where vLLM's venv is
installed and the run has vLLM tests, one in vLLM's venv for `vllm serve`, shared by every pytest-xdist worker.

The process that runs the session (xdist's controller, or pytest alone) starts both in the background before any
worker exists and names their sockets in the environment the workers inherit, so each server's preload (~9 and
~23 CPU-seconds) is paid once per run rather than once per worker. A server serves any requester whose environment
differs from its own only in variables read at run time, and the workers' differ only in what pytest and
pytest-xdist set (`TEST_RUNNER_VARS`). A server is ready once its marker file exists: a worker waits for the pdserve
one before its first test, and a vLLM instance waits for the vLLM one (whose start installs vLLM's venv first where
it is missing), since a spawned instance would cost as much as the server's whole preload.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pdserve.launcher import Process, start_command

READY = "ready"  # the marker beside a server's socket, written once it answers
FAILED = "failed"  # ...or why it could not start, so that nobody waits for it


def ready(socket: str) -> bool:
    return (Path(socket).parent / READY).exists()


def failure(socket: str) -> str | None:
    path = Path(socket).parent / FAILED
    return path.read_text() if path.exists() else None


def wait_ready(socket: str, timeout: float) -> str | None:
    """Wait until the server on `socket` is ready: None once it is, else why not (it failed, or the deadline)."""
    deadline = time.monotonic() + timeout
    while not ready(socket):
        if (failed := failure(socket)) is not None:
            return failed
        if time.monotonic() > deadline:
            return f"not ready in {timeout:.0f} s"
        time.sleep(0.1)
    return None


def pdserve_fork_server(folder: Path) -> Process:
    return start_command("forkserver", [sys.executable, "-m", "pdserve.forkserver", str(folder / "socket")])


class ForkServers:
    """Starts the run's fork servers in the background and stops them at the end of the run."""

    def __init__(self) -> None:
        self._started: list[tuple[str, Path, threading.Thread]] = []  # (its variable, its folder, its start)
        self._servers: list[Process] = []  # read only once every start has been joined

    def start(self, env_var: str, launch: Callable[[Path], Process]) -> None:
        """Start `launch(folder)` in the background; `env_var` names the socket it will answer on from now."""
        folder = Path(tempfile.mkdtemp(prefix="pdserve-forks-"))
        os.environ[env_var] = str(folder / "socket")

        def run() -> None:
            try:
                self._servers.append(launch(folder))
            except BaseException as exc:  # noqa: BLE001 (a thread: pytest's skip included) its processes are spawned
                (folder / FAILED).write_text(f"{exc!r}")
                return
            (folder / READY).touch()

        thread = threading.Thread(target=run, name=f"start-{env_var}", daemon=True)
        thread.start()
        self._started.append((env_var, folder, thread))

    def stop(self) -> None:
        for env_var, _folder, thread in self._started:
            thread.join()
            os.environ.pop(env_var, None)
        for server in self._servers:
            server.stop()
        for _env_var, folder, _thread in self._started:
            shutil.rmtree(folder, ignore_errors=True)


def run_uses_vllm(paths: list[str]) -> bool:
    """Whether a test file under `paths` (the run's arguments, or the tests folder) takes anything from vllm_live:
    read as text, since the process that starts the servers collects nothing when workers do."""
    files: list[Path] = []
    for arg in paths:
        path = Path(arg.split("::", 1)[0])
        if path.suffix == ".py":
            files.append(path)
        for root, folders, names in os.walk(path):  # nothing for a file; venvs and caches are hidden folders
            folders[:] = [name for name in folders if not name.startswith(".")]
            files += [Path(root, name) for name in names if name.startswith("test_") and name.endswith(".py")]
    return any(uses_vllm(file) for file in files)


def uses_vllm(file: Path) -> bool:
    """Whether a test file takes anything from vllm_live."""
    return file.exists() and "vllm_live" in file.read_text(errors="replace")
