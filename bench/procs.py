"""Process helpers for bench/transfer.py: CPU time of other processes, and an opt-in event trace of pdserve servers.

The trace changes no pdserve code: `child_env(dir, trace)` returns environment variables that put a generated
`sitecustomize.py` on the child's PYTHONPATH; at start-up it imports `install_trace` from this file, which wraps a
few methods (engine steps, command arrival, output delivery, transfer-agent loads and side-channel requests, data
plane reads) with `time.monotonic()` stamps written as JSON lines. CLOCK_MONOTONIC is system-wide on Linux, so the
stamps of several processes (and of the benchmark client) share one time line. The same hook can apply
`EXPERIMENTS`: small what-if patches that measure a suggested pdserve change before anyone makes it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_BENCH_DIR = Path(__file__).resolve().parent
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far; resolution 1 / CLK_TCK."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime (fields 14 and 15 of the full line)


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


class Contention:
    """Cores used by processes other than this one and the ones it started (`pids`), and hypervisor steal.

    Like bench/common.py's CpuMeter, but the benchmark's own children (pool owner, instances) do not count."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self._mark = self._read()

    def _read(self) -> tuple[float, float, float, float]:
        try:
            f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            f = [0] * 8
        busy = sum(f[i] for i in (0, 1, 2, 5, 6) if i < len(f)) / _CLK_TCK
        steal = (f[7] if len(f) > 7 else 0) / _CLK_TCK
        t = os.times()
        mine = t.user + t.system
        for pid in self.pids:
            try:
                mine += cpu_seconds(pid)
            except (OSError, IndexError, ValueError):
                pass
        return time.monotonic(), busy, steal, mine

    def mark(self) -> None:
        self._mark = self._read()

    def since_mark(self) -> dict[str, float]:
        t0, busy0, steal0, mine0 = self._mark
        t1, busy1, steal1, mine1 = self._read()
        dt = max(t1 - t0, 1e-9)
        return {"others": max((busy1 - busy0) - (mine1 - mine0), 0.0) / dt, "steal": (steal1 - steal0) / dt}

    def wait_for_quiet(self, max_wait_s: float, threshold: float = 0.25, window_s: float = 0.5) -> float:
        start = time.monotonic()
        while time.monotonic() - start < max_wait_s:
            self.mark()
            time.sleep(window_s)
            if self.since_mark()["others"] < threshold:
                break
        return time.monotonic() - start


# ----------------------------------------------------------------------------- tracing of server processes

_SITECUSTOMIZE = f"""\
import os, sys
if os.environ.get("PDSERVE_BENCH_TRACE") or os.environ.get("PDSERVE_BENCH_EXPERIMENTS"):
    sys.path.insert(0, {str(_BENCH_DIR)!r})
    import procs as _pdserve_bench_procs
    del sys.path[0]
    if os.environ.get("PDSERVE_BENCH_EXPERIMENTS"):
        _pdserve_bench_procs.install_experiments(os.environ["PDSERVE_BENCH_EXPERIMENTS"].split(","))
    if os.environ.get("PDSERVE_BENCH_TRACE"):
        _pdserve_bench_procs.install_trace(os.environ["PDSERVE_BENCH_TRACE"])
"""

EXPERIMENTS = {
    "nodelay": "HTTP server socket made with proto IPPROTO_TCP, so asyncio sets TCP_NODELAY on accepted connections",
    "nopoll": "engine loop does not sleep _IDLE_POLL_S after a step that saw a remote load finish",
    "prefault": "shm data plane: memfd pool pages touched at allocation, peer pools mapped with MAP_POPULATE",
    "sortruns": "read_blocks sorts the (remote, local) pairs by remote id first, so descending ids merge into runs",
}


def child_env(work_dir: Path, trace_path: Path | None = None, experiments: list[str] | None = None) -> dict[str, str]:
    """Environment for a `python -m pdserve serve` child: an event trace into `trace_path` and/or what-if patches."""
    site_dir = work_dir / "trace-site"
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(site_dir), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path}
    if trace_path is not None:
        env["PDSERVE_BENCH_TRACE"] = str(trace_path)
    if experiments:
        unknown = set(experiments) - set(EXPERIMENTS)
        if unknown:
            raise ValueError(f"unknown experiments {sorted(unknown)}; known: {sorted(EXPERIMENTS)}")
        env["PDSERVE_BENCH_EXPERIMENTS"] = ",".join(experiments)
    return env


def install_experiments(names: list[str]) -> None:
    """What-if patches of a server process, to measure a suggested change without editing pdserve."""
    import socket

    if "nodelay" in names:
        from pdserve.server import launch

        def bind_socket(host: str, port: int) -> socket.socket:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                                 socket.IPPROTO_TCP)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(2048)
            sock.set_inheritable(True)
            return sock

        launch.bind_socket = bind_socket
    if "nopoll" in names:
        from pdserve.engine import async_engine as ae

        orig_wait = ae.AsyncEngine._wait

        def _wait(self, timeout: float) -> None:
            if timeout == ae._IDLE_POLL_S and self.engine.scheduler.finished_recving:
                self._wakeup.clear()
                return  # a load just finished: schedule the request now
            orig_wait(self, timeout)

        ae.AsyncEngine._wait = _wait
    if "prefault" in names:
        import mmap

        import torch

        from pdserve.kv_transfer.data_plane import shm

        def map_pool(fd, shape, dtype):
            size = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
            return mapping, torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(*shape)

        shm.map_pool = map_pool

        orig_allocate = shm.ShmDataPlane.allocate

        def allocate(self, shape, dtype):
            kv = orig_allocate(self, shape, dtype)
            kv.zero_()  # populate every page now instead of on the first prefill / load into it
            return kv

        shm.ShmDataPlane.allocate = allocate
    if "sortruns" in names:
        from pdserve.kv_transfer.data_plane import shm, tcp

        def sorting(orig):
            def read_blocks(self, key, token, remote_ids, local_ids):
                pairs = sorted(zip(remote_ids, local_ids))
                return orig(self, key, token, [r for r, _ in pairs], [loc for _, loc in pairs])
            return read_blocks

        shm.ShmPeer.read_blocks = sorting(shm.ShmPeer.read_blocks)
        tcp.TcpPeer.read_blocks = sorting(tcp.TcpPeer.read_blocks)


class _Tracer:
    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
        self.lock = threading.Lock()
        self.last_scheduled = 0

    def ev(self, name: str, t: float | None = None, **fields: Any) -> None:
        line = json.dumps({"t": time.monotonic() if t is None else t, "ev": name, **fields})
        with self.lock:
            self.file.write(line + "\n")


def stampers(tracer: _Tracer) -> tuple[Callable[..., None], Callable[..., None]]:
    """stamp(owner, name, label, fields) and its async twin: replace owner.name by a wrapper that records one
    event with its start, duration and fields(*args) each call (class attributes, so later instances use it)."""
    now = time.monotonic

    def stamp(owner: Any, name: str, label: str, fields: Callable[..., dict] = lambda *a, **k: {}) -> None:
        orig = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = now()
            try:
                return orig(*a, **k)
            finally:
                tracer.ev(label, t0, dur=now() - t0, **fields(*a, **k))

        setattr(owner, name, wrapper)

    def stamp_async(owner: Any, name: str, label: str, fields: Callable[..., dict] = lambda *a, **k: {}) -> None:
        orig = getattr(owner, name)

        async def wrapper(*a, **k):
            t0 = now()
            try:
                return await orig(*a, **k)
            finally:
                tracer.ev(label, t0, dur=now() - t0, **fields(*a, **k))

        setattr(owner, name, wrapper)

    return stamp, stamp_async


def sse_data(client: Any, url: str, body: dict) -> Iterator[tuple[float, str]]:
    """POST a streamed request to url; yield (arrival time, payload) of every SSE data line up to [DONE]."""
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line[6:] == "[DONE]":
                break
            yield time.monotonic(), line[6:]


def print_timeline(title: str, label: str, cols: list[str], prof: dict[str, dict[str, float]]) -> None:
    """One column per mode, one row per segment (rows whose name starts with # are counts)."""
    width = max(len(c) for c in cols) + 2
    print(f"\n  {title}")
    print(f"  {label:<52}" + "".join(f"{c:>{width}}" for c in cols))
    for k in dict.fromkeys(k for c in cols for k in prof[c]):
        spec = ".0f" if k.startswith("#") else ".2f"
        print(f"  {k[:52]:<52}" + "".join(f"{format(prof[c].get(k, float('nan')), spec):>{width}}" for c in cols))


def write_json(path: str | Path | None, results: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=1, default=str))
        print(f"  wrote {path}")


def install_trace(path: str) -> None:
    """Wrap pdserve methods (class attributes, so every instance made later uses them) to stamp events."""
    from pdserve.engine import async_engine as ae
    from pdserve.engine.scheduler import Scheduler
    from pdserve.kv_transfer import agent as ag
    from pdserve.kv_transfer.data_plane import shm, tcp
    from pdserve.kv_transfer.side_channel import SideChannelClient

    tr = _Tracer(path)
    now = time.monotonic

    orig_schedule = Scheduler.schedule

    def schedule(self):
        out = orig_schedule(self)
        tr.last_scheduled = out.num_scheduled_tokens
        return out

    Scheduler.schedule = schedule

    orig_step = ae.AsyncEngine._step

    def _step(self):
        t0 = now()
        orig_step(self)
        if tr.last_scheduled:  # steps that ran nothing (waiting on a transfer) are only counted
            tr.ev("step", t0, dur=now() - t0, n=tr.last_scheduled)
        else:
            tr.ev("idle_step", t0, dur=now() - t0)

    ae.AsyncEngine._step = _step

    orig_send = ae.AsyncEngine._send

    def _send(self, command):
        if isinstance(command, ae._Add):
            tr.ev("add", n=len(command.prompt_token_ids))
        orig_send(self, command)

    ae.AsyncEngine._send = _send

    orig_wake = ae.AsyncEngine.wake

    def wake(self):
        tr.ev("wake")
        orig_wake(self)

    ae.AsyncEngine.wake = wake

    orig_deliver = ae.AsyncEngine._deliver_threadsafe

    def _deliver_threadsafe(self, outputs):
        tr.ev("deliver", n=len(outputs), fin=any(o.finished for o in outputs))
        orig_deliver(self, outputs)

    ae.AsyncEngine._deliver_threadsafe = _deliver_threadsafe

    stamp, stamp_async = stampers(tr)

    from pdserve.kv_transfer.data_plane.base import block_runs

    msg_type = lambda self, message, *a, **k: {"msg": type(message).__name__}  # noqa: E731

    def nblocks(self, key, token, remote_ids, local_ids, *a, **k):
        pairs = sorted(zip(remote_ids, local_ids))
        return {"n": len(remote_ids), "runs": len(block_runs(list(remote_ids), list(local_ids))),
                "runs_sorted": len(block_runs([r for r, _ in pairs], [loc for _, loc in pairs]))}
    stamp(ag.TransferAgent, "submit_load", "submit_load")
    stamp(ag.TransferAgent, "hold", "hold")
    stamp(ag.TransferAgent, "_finish_load", "finish_load")
    stamp_async(ag.TransferAgent, "_handle", "handle", msg_type)
    stamp_async(ag.TransferAgent, "peer", "peer")
    stamp_async(SideChannelClient, "request", "request", msg_type)
    stamp(shm.ShmPeer, "read_blocks", "read_blocks", nblocks)
    stamp(tcp.TcpPeer, "read_blocks", "read_blocks", nblocks)
    stamp(tcp.TcpDataPlane, "_answer", "tcp_answer")


def read_trace(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    events.sort(key=lambda e: e["t"])
    return events
