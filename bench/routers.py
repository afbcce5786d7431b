"""Helpers for bench/gateway.py: start the stub backends and the routers (pdserve gateway, vllm-router,
sglang-router), read CPU time of process trees from /proc, and drive wrk.

Every process is started by this module with its own session, bound to 127.0.0.1 on a free port, and stopped
by PID (SIGTERM, then SIGKILL), together with any descendants it had, in the caller's `finally`.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
PEERS_DIR = ROOT / ".cache" / "peers"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- /proc


def _stat_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (all its threads); 0 if it is gone. Resolution 1 / CLK_TCK."""
    try:
        f = _stat_fields(pid)
    except (OSError, IndexError):
        return 0.0
    return (int(f[11]) + int(f[12])) / CLK_TCK


def sys_seconds(pid: int) -> float:
    """stime alone (kernel time: syscalls, and on loopback the receiver's side of TCP too)."""
    try:
        return int(_stat_fields(pid)[12]) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def sched_seconds(pid: int) -> float:
    """CPU seconds of a live process's threads from /proc/<pid>/task/*/schedstat (nanosecond resolution; a
    cross-check of utime+stime, which the kernel accounts in ticks)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


def descendants(root: int) -> list[int]:
    """`root` and every live process below it (ppid chains read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(entry))[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def box_busy_seconds() -> float:
    """CPU-seconds all cores spent busy (user nice system irq softirq) since boot."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(f[i] for i in (0, 1, 2, 5, 6)) / CLK_TCK


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """A process this benchmark started (own session); `tree` is refreshed with its descendants."""

    name: str
    popen: subprocess.Popen
    url: str
    log_path: Path
    tree: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def refresh_tree(self) -> list[int]:
        if self.alive():
            self.tree = descendants(self.pid)
        return self.tree

    def cpu(self) -> float:
        return sum(cpu_seconds(p) for p in self.tree or [self.pid])

    def sys(self) -> float:
        return sum(sys_seconds(p) for p in self.tree or [self.pid])

    def sched(self) -> float:
        return sum(sched_seconds(p) for p in self.tree or [self.pid])

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM by PID, then SIGKILL; then any descendant still alive, by PID."""
        tree = [p for p in (self.refresh_tree() if self.alive() else self.tree) if p != self.pid]
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGTERM)
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(5)
            except ProcessLookupError:
                pass
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.popen.stdout is not None:
            self.popen.stdout.close()


def spawn(name: str, cmd: list[str], log_dir: Path, env: dict[str, str] | None = None,
          stdout_pipe: bool = False) -> tuple[subprocess.Popen, Path]:
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(cmd, stdout=subprocess.PIPE if stdout_pipe else log, stderr=log,
                                 stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                                 start_new_session=True, cwd=str(ROOT))
    return popen, log_path


def wait_ready_line(popen: subprocess.Popen, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    buf = b""
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"exited with code {popen.returncode}")
        readable, _, _ = select.select([popen.stdout], [], [], 0.1)
        if not readable:
            continue
        chunk = os.read(popen.stdout.fileno(), 65536)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("event") == "ready":
                return msg
    raise RuntimeError(f"no ready line within {timeout} s")


def start_stub(name: str, role: str, log_dir: Path) -> Proc:
    cmd = [sys.executable, str(BENCH_DIR / "stub_backend.py"), "--port", "0", "--role", role]
    popen, log_path = spawn(name, cmd, log_dir, stdout_pipe=True)
    try:
        ready = wait_ready_line(popen, 30)
    except BaseException:
        proc = Proc(name, popen, "", log_path)
        proc.stop()
        raise
    proc = Proc(name, popen, f"http://127.0.0.1:{ready['port']}", log_path)
    proc.refresh_tree()
    return proc


def post(url: str, path: str, body: bytes, timeout: float = 5.0) -> tuple[int, bytes, dict[str, str]]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body, {"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def wait_serving(proc: Proc, body: bytes, timeout: float) -> None:
    """Poll a real completion until it answers 200 (sglang-router registers its workers after 'ready')."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}): {proc.log_tail()}")
        try:
            status, data, _ = post(proc.url, "/v1/completions", body, timeout=2)
            if status == 200:
                return
            last = f"{status} {data[:200]!r}"
        except OSError as exc:
            last = repr(exc)
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name} not serving within {timeout} s (last: {last}): {proc.log_tail()}")


def start_pdserve(p_url: str, d_url: str, log_dir: Path, extra: list[str] | None = None,
                  name: str = "pdserve", body: bytes = b"", env: dict[str, str] | None = None) -> Proc:
    args = [sys.executable, "-m", "pdserve", "gateway", "--prefill", p_url, "--decode", d_url,
            "--protocol", "pull", "--scheduling", "batch", "--policy", "round_robin", "--host", "127.0.0.1",
            "--port", "0", "--log-level", "warning", *(extra or [])]
    popen, log_path = spawn(name, args, log_dir, env={"PYTHONUNBUFFERED": "1", **(env or {})},
                            stdout_pipe=True)
    proc = Proc(name, popen, "", log_path)
    try:
        ready = wait_ready_line(popen, 60)
        proc.url = f"http://127.0.0.1:{ready['port']}"
        wait_serving(proc, body, 30)
    except BaseException:
        proc.stop()
        raise
    proc.refresh_tree()
    return proc


def ensure_venv(name: str, package: str, entry: str) -> Path:
    """`.cache/peers/NAME` with PACKAGE pip-installed (reused when its entry point is there)."""
    venv = PEERS_DIR / name
    exe = venv / "bin" / entry
    if exe.exists():
        return exe
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", None) or sys.executable
    print(f"installing {package} into {venv} ...", flush=True)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", package], check=True)
    if not exe.exists():
        raise RuntimeError(f"{package} installed but {exe} is missing")
    return exe


def start_vllm_router(p_url: str, d_url: str, log_dir: Path, body: bytes) -> Proc:
    exe = ensure_venv("vllm-router", "vllm-router", "vllm-router")
    port = free_port()
    cmd = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
           "--prefill", p_url, "--decode", d_url, "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port()), "--log-level", "warning"]
    popen, log_path = spawn("vllm-router", cmd, log_dir)
    proc = Proc("vllm-router", popen, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_serving(proc, body, 60)
    except BaseException:
        proc.stop()
        raise
    proc.refresh_tree()
    return proc


def start_sglang_router(p_url: str, d_url: str, log_dir: Path, body: bytes) -> Proc:
    exe = ensure_venv("sglang-router", "sglang-router", "sglang-router")
    port = free_port()
    # The bootstrap port is only copied into request bodies (bootstrap_port); nothing listens on it here.
    cmd = [str(exe), "launch", "--host", "127.0.0.1", "--port", str(port), "--pd-disaggregation",
           "--prefill", p_url, str(free_port()), "--decode", d_url, "--policy", "round_robin",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
    popen, log_path = spawn("sglang-router", cmd, log_dir, env={"HF_HUB_OFFLINE": "1"})
    proc = Proc("sglang-router", popen, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_serving(proc, body, 90)
    except BaseException:
        proc.stop()
        raise
    proc.refresh_tree()
    return proc


# ----------------------------------------------------------------------------- wrk

_WRK_LUA = """\
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRKJSON {{"requests":%d,"duration_us":%d,"bytes":%d,"connect":%d,"read":%d,' ..
    '"write":%d,"timeout":%d,"non2xx":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f,"max_us":%d}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean, latency.max))
end
"""


def lua_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_wrk_script(directory: Path, name: str, body: bytes) -> Path:
    path = directory / f"{name}.lua"
    path.write_text(_WRK_LUA.format(body=lua_string(body.decode())))
    return path


def find_wrk() -> str:
    for cand in ("/usr/bin/wrk", "/usr/local/bin/wrk"):
        if os.access(cand, os.X_OK):
            return cand
    raise SystemExit("wrk not found: apt-get install -y wrk")


def run_wrk(wrk: str, url: str, script: Path, conns: int, seconds: float, path: str = "/v1/completions"
            ) -> tuple[dict[str, Any], float]:
    """Run wrk -t1 -cN; returns its summary (from the Lua `done`) and its own CPU seconds (from wait4)."""
    cmd = [wrk, "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--timeout", "5s", "-s", str(script),
           url + path]
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = popen.stdout.read().decode(errors="replace")
        _, status, usage = os.wait4(popen.pid, 0)
        popen.returncode = os.waitstatus_to_exitcode(status)
    finally:
        if popen.returncode is None:
            os.kill(popen.pid, signal.SIGKILL)
            popen.wait()
        popen.stdout.close()
    for line in out.splitlines():
        if line.startswith("WRKJSON "):
            return json.loads(line[8:]), usage.ru_utime + usage.ru_stime
    raise RuntimeError(f"wrk gave no summary (rc {popen.returncode}): {out[-2000:]}")


def temp_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="pdserve-bench-gateway-"))
