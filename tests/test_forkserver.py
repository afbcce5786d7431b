"""The tests' fork server (pdserve/forkserver.py): a process it forks serves and ends as a spawned `python -m pdserve`
would, with the requester's environment, directory and output, and what it cannot fork as such is spawned."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pdserve.forkserver import ENV_VAR, VERSION, ForkedChild, SpawnRequest, fork, refusal
from pdserve.launcher import LaunchError, start_command, start_instance
from server_utils import wait_for

SMALL = ("--num-kv-blocks", "32", "--max-model-len", "128", "--log-level", "info", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """A fork server of this module's own (the run's serves everything else), stopped at the end."""
    folder = tmp_path_factory.mktemp("forks")
    proc = start_command("forkserver", [sys.executable, "-m", "pdserve.forkserver", str(folder / "socket")])
    yield proc
    proc.stop()


@pytest.fixture()
def forking(server, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(ENV_VAR, server.ready["socket"])
    return server


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def socket_inodes(pid: int) -> set[str]:
    links = (os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir())
    return {link for link in links if link.startswith("socket:")}


def test_a_forked_instance_serves_with_the_requesters_environment(forking, models):
    proc = start_instance(models("llama"), *SMALL, name="forked", env={"VLLM_API_KEY": "sesame"})
    try:
        assert isinstance(proc.popen, ForkedChild) and parent_of(proc.pid) == forking.pid
        assert os.getsid(proc.pid) == proc.pid
        assert os.readlink(f"/proc/{proc.pid}/cwd") == os.getcwd()
        assert not socket_inodes(proc.pid) & socket_inodes(forking.pid), "the server's sockets leaked into a child"
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
        assert httpx.post(f"{proc.url}/v1/completions", json=body, timeout=60).status_code == 401
        served = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=60,
                            headers={"Authorization": "Bearer sesame"})
        assert served.status_code == 200, served.text
        # The access log line is written once the answer has gone out: a client can read the file before it lands.
        wait_for(lambda: "POST /v1/completions" in proc.log_tail(), 10, "the child's log to reach the requester's file")
    finally:
        proc.stop()
    assert proc.popen.returncode == 0, "SIGTERM should drain the instance to exit status 0"


def test_exit_statuses_come_back_from_the_server(forking, models, tmp_path: Path):
    with pytest.raises(LaunchError, match=r"\(exited with code 2\).*model folder .* does not exist"):
        start_instance(tmp_path / "missing", *SMALL, name="missing")
    proc = start_instance(models("llama"), *SMALL, name="killed")
    proc.kill()
    assert proc.popen.returncode == -9
    assert proc.popen.poll() == -9 and proc.popen.wait(0) == -9


@pytest.mark.parametrize("name, value, libraries", [("UCX_MODULES", "^ib,^rdmacm", ("libucs", "libucp")),
                                                     ("UCX_MEM_EVENTS", "no", ("libucs", "libucm")),
                                                     ("MC_LOG_LEVEL", "INFO", ("mooncake/engine",))])
def test_a_requester_that_used_a_transfer_engine_still_forks(forking, models, monkeypatch: pytest.MonkeyPatch,
                                                            name: str, value: str, libraries: tuple[str, ...]):
    # pdserve's planes set these in their own process (a NIXL agent UCX_MODULES and UCX_MEM_EVENTS, the Mooncake
    # plane MC_LOG_LEVEL); each engine reads its variable only as it starts, which the server never does, so a
    # test that ran a plane in-process must not turn every later instance into a full import.
    monkeypatch.setenv(name, value)
    proc = start_instance(models("llama"), *SMALL, name=f"after-{name}")
    try:
        assert isinstance(proc.popen, ForkedChild) and parent_of(proc.pid) == forking.pid
    finally:
        proc.stop()
    maps = Path(f"/proc/{forking.pid}/maps").read_text()
    assert not any(library in maps for library in libraries), f"the server loaded the engine: {name} is read there"


@pytest.mark.filterwarnings("ignore:spawned is spawned, not forked")
def test_what_may_have_been_read_at_import_is_spawned(forking, models):
    proc = start_instance(models("llama"), *SMALL, name="spawned", env={"OMP_NUM_THREADS": "1"})
    try:
        assert isinstance(proc.popen, subprocess.Popen) and parent_of(proc.pid) == os.getpid()
    finally:
        proc.stop()


def test_the_refusal_rule():
    env = dict(os.environ)
    request = SpawnRequest(VERSION, sys.executable, ["serve"], env, os.getcwd())
    assert refusal(request) is None
    assert refusal(SpawnRequest(VERSION, sys.executable, [], {**env, "PDSERVE_ANYTHING": "1"}, os.getcwd())) is None
    worker = {"PYTEST_XDIST_WORKER": "gw7", "PYTEST_XDIST_WORKER_COUNT": "8", "PYTEST_XDIST_TESTRUNUID": "f00",
              "COLUMNS": "80", "LINES": "24", "SHLVL": "3", "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_x"}
    assert refusal(SpawnRequest(VERSION, sys.executable, [], {**env, **worker}, os.getcwd())) is None
    for changed, named in (({**env, "OMP_NUM_THREADS": "7"}, "OMP_NUM_THREADS"),
                           ({k: v for k, v in env.items() if k != "PATH"}, "PATH")):
        assert named in refusal(SpawnRequest(VERSION, sys.executable, [], changed, os.getcwd()))
    assert "working directory" in refusal(SpawnRequest(VERSION, sys.executable, [], env, "/"))
    assert "interpreter" in refusal(SpawnRequest(VERSION, "/usr/bin/python3", [], env, os.getcwd()))


@pytest.mark.skipif(ENV_VAR not in os.environ, reason="the run has no fork server (--no-fork-server)")
def test_one_server_forks_for_every_worker_of_the_run(models):
    # The run's server is started by the process that runs the session, before any pytest-xdist worker: its parent
    # is the parent of this worker, or this process when pytest runs alone.
    proc = start_instance(models("llama"), *SMALL, name="shared")
    try:
        assert isinstance(proc.popen, ForkedChild)
        session = os.getppid() if "PYTEST_XDIST_WORKER" in os.environ else os.getpid()
        assert parent_of(parent_of(proc.pid)) == session
    finally:
        proc.stop()


def test_what_is_not_a_spawn_request_is_refused_and_no_server_means_spawn(server, tmp_path: Path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(30)
        conn.connect(server.ready["socket"])
        conn.send(b"not json")
        assert b"refused" in conn.recv(1 << 16)
    with open(os.devnull, "wb") as sink:
        why = fork(str(tmp_path / "nobody"), [sys.executable, "-m", "pdserve"], {}, sink.fileno())
    assert why.startswith("no fork server")


def test_stopping_the_server_kills_what_it_still_runs(models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    own = start_command("forkserver", [sys.executable, "-m", "pdserve.forkserver", str(tmp_path / "socket")])
    try:
        monkeypatch.setenv(ENV_VAR, own.ready["socket"])
        proc = start_instance(models("llama"), *SMALL, name="orphan")
        own.stop()
        assert own.popen.returncode == 0
        assert proc.popen.wait(10) == -9
        assert not Path(f"/proc/{proc.pid}").exists()
    finally:
        own.stop()
