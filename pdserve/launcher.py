"""Starting pdserve processes (instances, gateways) and stopping them by PID, for tests, demos and benchmarks.

Every process binds 127.0.0.1 on an ephemeral port and announces itself with one JSON line on stdout; waiting for
that line has a deadline, and stopping escalates from SIGTERM to SIGKILL.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.forkserver import ENV_VAR as FORKSERVER_ENV
from pdserve.forkserver import ForkedChild, fork

logger = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    pass


@dataclass
class Process:
    name: str
    popen: subprocess.Popen | ForkedChild
    ready: dict[str, Any]
    log_path: Path
    signal_group: bool = False  # signal its whole process group: a wrapper (unshare --fork) forwards no signals
    _stopped: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def port(self) -> int:
        return int(self.ready["port"])

    @property
    def url(self) -> str:
        return f"http://{self.ready.get('host', '127.0.0.1')}:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _signal(self, signum: int) -> None:
        if self.signal_group:
            os.killpg(self.pid, signum)  # started in its own session: its group id is its PID
        else:
            self.popen.send_signal(signum)  # never reaches a recycled PID: it checks the child has not been reaped

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            self._signal(signal.SIGKILL)
            self.popen.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        stop_all([self], timeout)

    def _forget(self) -> None:
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        if os.environ.get("PDSERVE_KEEP_LOGS"):  # a failed run's logs, kept for whoever reads it afterwards
            return
        try:
            self.log_path.unlink()
        except OSError:
            pass


def stop_all(procs: Iterable[Any], timeout: float = 15.0) -> None:
    """Stop processes together: SIGTERM to every one, then one deadline for all (SIGKILL past it). An instance's
    SIGTERM drains it, and a drain lingers a couple of seconds for probing gateways to see it leave: stopped one
    after another, N instances take N lingers; together, one. Anything else with a `stop()` is stopped by it."""
    todo = []
    for proc in procs:
        if not isinstance(proc, Process):
            proc.stop()
        elif not proc._stopped:
            proc._stopped = True
            if proc.alive():
                proc._signal(signal.SIGTERM)
            todo.append(proc)
    deadline = time.monotonic() + timeout
    for proc in todo:
        try:
            proc.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc._signal(signal.SIGKILL)
            proc.popen.wait(10)
        proc._forget()


def start(name: str, args: list[str], timeout: float = 120.0, env: dict[str, str] | None = None,
          wrap: list[str] | None = None) -> Process:
    """Run `python -m pdserve ARGS` (which must announce readiness) and wait for its ready line.

    `wrap` prefixes the command (e.g. `ip netns exec NS unshare --pid --fork --kill-child`); the process is then
    stopped through its process group, since such a wrapper does not pass signals on.
    """
    return start_command(name, [*(wrap or []), sys.executable, "-m", "pdserve", *args], timeout, env, bool(wrap))


def start_command(name: str, argv: list[str], timeout: float = 120.0, env: dict[str, str] | None = None,
                  signal_group: bool = False, inherit_env: bool = True) -> Process:
    """Run any command that announces readiness with a JSON line on stdout, and wait for that line. Its environment
    is this process's updated with `env`, or `env` alone with inherit_env=False."""
    fd, log_name = tempfile.mkstemp(prefix=f"pdserve-{name}-", suffix=".log")
    os.close(fd)
    log_path = Path(log_name)
    full_env = {**(os.environ if inherit_env else {}), "PYTHONUNBUFFERED": "1", **(env or {})}
    with log_path.open("wb") as log_file:
        popen = _spawn(name, argv, full_env, log_file.fileno())
    proc = Process(name, popen, {}, log_path, signal_group)
    try:
        proc.ready = _wait_ready(popen, timeout)
    except BaseException as exc:  # a Ctrl-C while waiting must not leave the child running either
        tail = proc.log_tail()
        proc.stop()
        if not isinstance(exc, Exception):
            raise
        raise LaunchError(f"{name} did not become ready ({exc}): {tail}") from None
    threading.Thread(target=_drain, args=(popen, log_path), daemon=True).start()
    return proc


def _spawn(name: str, argv: list[str], env: dict[str, str], stderr: int) -> subprocess.Popen | ForkedChild:
    """`python -m pdserve ...` comes from the fork server named in the environment where there is one and it agrees
    (tests: it saves importing torch and the web stack per process); anything else is spawned. A fork server that
    could not fork says why in a warning: each such process costs a full import, which a test suite should hear."""
    server = os.environ.get(FORKSERVER_ENV)
    if server and argv[:3] == [sys.executable, "-m", "pdserve"]:
        child = fork(server, argv, env, stderr)
        if isinstance(child, ForkedChild):
            return child
        logger.warning("%s is spawned, not forked: %s", name, child)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, env=env, start_new_session=True)


def _drain(popen: subprocess.Popen, log_path: Path) -> None:
    """Keep reading the child's stdout after its ready line, so a full pipe can never block it."""
    try:
        with log_path.open("ab") as log_file:
            for line in popen.stdout:
                log_file.write(line)
    except (OSError, ValueError):
        pass


def _wait_ready(popen: subprocess.Popen, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    assert popen.stdout is not None
    buffer = b""
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise LaunchError(f"exited with code {popen.returncode}")
        readable, _, _ = select.select([popen.stdout], [], [], 0.1)
        if not readable:
            continue
        chunk = os.read(popen.stdout.fileno(), 65536)
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict) and message.get("event") == "ready":
                return message
    raise LaunchError(f"no ready line within {timeout} s")


def start_instance(model: Path | str, *extra: str, name: str = "instance", timeout: float = 120.0,
                   env: dict[str, str] | None = None, host: str = "127.0.0.1",
                   wrap: list[str] | None = None) -> Process:
    return start(name, ["serve", str(model), "--host", host, "--port", "0", *extra], timeout, env, wrap)
