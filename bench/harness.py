"""What every pdserve benchmark shares: statistics, the others'-CPU meter, machine probes, processes, HTTP seams.

Benchmarks measure only through public seams: the client's own clock around HTTP calls, `/metrics`, and the
per-request timeline every pdserve process serves at `GET /v1/timeline/{request_id}` (the client picks the id
with an `X-Request-Id` header). None of them patches pdserve code, so a refactor cannot silently break them.

The box is shared and noisy, so each script interleaves what it compares in rounds whose order rotates, records
how many cores *other* processes used during every measured repetition (`CpuMeter`), and prints ratios of medians.
Import torch (the probes) only after the caller has set OMP_NUM_THREADS.
"""

from __future__ import annotations

import atexit
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GiB, MiB = 1 << 30, 1 << 20
CLK_TCK = os.sysconf("SC_CLK_TCK")
QUIET_CORES = 0.3  # a repetition during which other processes used more cores than this is suspect


# ----------------------------------------------------------------------------- statistics


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None or v != v else format(v, spec)


@dataclass(slots=True)
class Summary:
    """min / median / max of a sample (any unit)."""

    n: int
    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            return cls(0, float("nan"), float("nan"), float("nan"))
        return cls(len(values), min(values), statistics.median(values), max(values))

    def fmt(self, spec: str = ".1f") -> str:
        if self.n <= 1:
            return format(self.median, spec)
        return f"{self.median:{spec}} ({self.min:{spec}}-{self.max:{spec}})"


def timeit(fn: Callable[[], Any], reps: int = 5, warmup: int = 1) -> list[float]:
    """Seconds per call of `fn`, `reps` times after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def rotations(items: Sequence[Any], rounds: int) -> Iterator[tuple[int, list[Any]]]:
    """(round, order) with the order rotated by one each round, so every item goes first equally often and
    background load drifting over the run hits all of them alike."""
    items = list(items)
    for r in range(rounds):
        k = r % max(len(items), 1)
        yield r, items[k:] + items[:k]


def to_jsonable(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return {k: to_jsonable(v) for k, v in asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return None
    return obj


def write_json(path: str | Path | None, results: Any) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(to_jsonable(results), indent=1, default=str))
        print(f"  wrote {path}")


# ----------------------------------------------------------------------------- /proc: CPU of others and of trees


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _stat_fields(pid: int, tid: int | None = None) -> list[str]:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    return Path(path).read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a live process (all its threads), or of its thread `tid`; 0 if it is gone. Resolution
    1 / CLK_TCK."""
    try:
        f = _stat_fields(pid, tid)
        return (int(f[11]) + int(f[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def descendants(root: int) -> list[int]:
    """`root` and every live process below it (ppid chains read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children.setdefault(int(_stat_fields(int(entry))[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


class CpuMeter:
    """How many cores processes *other* than this one and the ones it started (`pids`) used since `mark()`, and
    hypervisor steal.

    Two torch threads on a 2-core box collapse when anything else runs (each parallel region waits at its barrier
    for a descheduled thread), so a step can get 10-30x slower. Benchmarks record this next to every repetition
    and can wait for a quiet machine before measuring; the benchmark's own servers do not count as others."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self._mark = self._read()

    def _read(self) -> tuple[float, float, float, float]:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = sum(f[i] for i in (0, 1, 2, 5, 6)) / CLK_TCK  # user nice system irq softirq
        steal = f[7] / CLK_TCK
        t = os.times()
        mine = t.user + t.system + sum(cpu_seconds(p) for p in self.pids)
        return time.monotonic(), busy, steal, mine

    def mark(self) -> None:
        self._mark = self._read()

    def since_mark(self) -> dict[str, float]:
        t0, busy0, steal0, mine0 = self._mark
        t1, busy1, steal1, mine1 = self._read()
        dt = max(t1 - t0, 1e-9)
        return {"others": max((busy1 - busy0) - (mine1 - mine0), 0.0) / dt, "steal": (steal1 - steal0) / dt}

    def wait_for_quiet(self, max_wait_s: float, threshold: float = 0.25, window_s: float = 0.5) -> float:
        """Block until others use < threshold cores over a window, or max_wait_s passes; returns the wait."""
        start = time.monotonic()
        while time.monotonic() - start < max_wait_s:
            self.mark()
            time.sleep(window_s)
            if self.since_mark()["others"] < threshold:
                break
        return time.monotonic() - start


# ----------------------------------------------------------------------------- machine probe


@dataclass(slots=True)
class Hardware:
    threads: int
    cpu: str
    cpu_capability: str
    avx512_bf16: bool
    amx: bool
    copy_GBps: Summary  # dst.copy_(src), read + write counted
    matmul_fp32_GFLOPs: Summary
    matmul_bf16_GFLOPs: Summary
    copy_bytes: int
    matmul_n: int

    def describe(self) -> str:
        return (f"{self.cpu} | {self.cpu_capability}, avx512_bf16={self.avx512_bf16}, amx={self.amx} | "
                f"{self.threads} threads\n  memory copy {self.copy_bytes / GiB:.2f} GiB fp32 (read+write): best "
                f"{self.copy_GBps.max:.1f} / median {self.copy_GBps.median:.1f} GB/s\n  matmul {self.matmul_n}^3: "
                f"fp32 best {self.matmul_fp32_GFLOPs.max:.0f} / median {self.matmul_fp32_GFLOPs.median:.0f}, bf16 "
                f"best {self.matmul_bf16_GFLOPs.max:.0f} / median {self.matmul_bf16_GFLOPs.median:.0f} GFLOP/s")


def _cpu_info() -> tuple[str, set[str]]:
    info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines())
    info = {k.strip(): v.strip() for k, v in info.items()}
    return info.get("model name", platform.processor() or "?"), set(info.get("flags", "").split())


def probe_hardware(threads: int, copy_bytes: int = GiB, matmul_n: int = 2048, rounds: int = 3, reps: int = 2,
                   previous: Hardware | None = None) -> Hardware:
    """Memory bandwidth (a large fp32 copy) and GEMM peak (fp32, bf16) at `threads` torch threads.

    Samples are taken in rounds spread over a few seconds so one stall of the shared host cannot spoil them all;
    `previous` (a probe from the start of the run) is pooled in, and rooflines use the best sample."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    copy: list[float] = list(previous and [previous.copy_GBps.max, previous.copy_GBps.median] or [])
    rates: dict[Any, list[float]] = {torch.float32: [], torch.bfloat16: []}
    try:
        src = torch.randn(copy_bytes // 4)
        dst = torch.empty_like(src)
        mats = {dt: (torch.randn(matmul_n, matmul_n).to(dt), torch.randn(matmul_n, matmul_n).to(dt)) for dt in rates}
        for r in range(rounds):
            copy += [2 * copy_bytes / t / 1e9 for t in timeit(lambda: dst.copy_(src), reps=reps)]
            for dt, (a, b) in mats.items():
                rates[dt] += [2 * matmul_n ** 3 / t / 1e9 for t in timeit(lambda a=a, b=b: a @ b, reps=reps)]
            time.sleep(0.5 if r + 1 < rounds else 0)
    finally:
        torch.set_num_threads(saved)
    if previous:
        rates[torch.float32] += [previous.matmul_fp32_GFLOPs.max, previous.matmul_fp32_GFLOPs.median]
        rates[torch.bfloat16] += [previous.matmul_bf16_GFLOPs.max, previous.matmul_bf16_GFLOPs.median]
    name, flags = _cpu_info()
    return Hardware(threads, name, torch.backends.cpu.get_cpu_capability(), "avx512_bf16" in flags, "amx_bf16" in flags,
                    Summary.of(copy), Summary.of(rates[torch.float32]), Summary.of(rates[torch.bfloat16]),
                    copy_bytes, matmul_n)


# ----------------------------------------------------------------------------- the run's folder and its cleanup


class Cleanup:
    """Closers run in reverse order at exit, on SIGTERM or Ctrl-C: every process a benchmark started is stopped by
    its PID, and its temp folder removed, however the run ends."""

    def __init__(self) -> None:
        self.closers: list[Callable[[], None]] = []
        atexit.register(self.run)
        signal.signal(signal.SIGTERM, self._on_signal)

    @staticmethod
    def _on_signal(signum: int, frame: Any) -> None:  # noqa: ARG004
        raise KeyboardInterrupt(f"signal {signum}")

    def add(self, fn: Callable[[], None]) -> None:
        self.closers.append(fn)

    def run(self) -> None:
        while self.closers:
            try:
                self.closers.pop()()
            except Exception as exc:  # noqa: BLE001 - keep cleaning
                print(f"cleanup: {exc}", file=sys.stderr)

    def work_dir(self, name: str) -> Path:
        work = Path(tempfile.mkdtemp(prefix=f"pdserve-bench-{name}-"))
        self.add(lambda: shutil.rmtree(work, ignore_errors=True))
        return work


def simulated_hosts(cleanup: Cleanup, *names: str) -> Any:
    """Hosts on one bridge, each a network namespace (the tests' `netns.Network`), removed in the cleanup."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from netns import Network

    net = Network(*names)
    cleanup.add(net.close)
    return net


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Servers:
    """pdserve processes (instances, gateways) started for one benchmark, stopped by PID in the cleanup, their
    CPU excluded from the others'-CPU meter."""

    def __init__(self, cleanup: Cleanup, meter: CpuMeter) -> None:
        self.cleanup, self.meter = cleanup, meter
        self.procs: dict[str, Any] = {}

    def instance(self, key: str, model: Path, *args: str, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1", wrap: list[str] | None = None) -> Any:
        """`host` and `wrap` place it on a simulated host (tests/netns.py: `Host.address`, `Host.wrap()`)."""
        from pdserve.launcher import start_instance

        return self._keep(key, start_instance(model, *args, name=key, env=env, timeout=180, host=host, wrap=wrap))

    def gateway(self, key: str, *args: str, host: str = "127.0.0.1", wrap: list[str] | None = None,
                log_level: str = "warning") -> Any:
        from pdserve.launcher import start

        return self._keep(key, start(key, ["gateway", *args, "--host", host, "--port", "0", "--log-level",
                                           log_level], wrap=wrap))

    def _keep(self, key: str, proc: Any) -> Any:
        self.procs[key] = proc
        self.cleanup.add(proc.stop)
        self.meter.pids += descendants(proc.pid)  # a wrapped server runs below its wrapper
        return proc

    def url(self, key: str) -> str:
        return self.procs[key].url

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()
        self.procs.clear()

    def describe(self) -> str:
        return ", ".join(f"{n} pid {p.pid}" for n, p in self.procs.items())


def kv_config(role: str, plane: str = "auto", **extra: Any) -> str:
    cfg: dict[str, Any] = {"kv_connector": "PdConnector", "kv_role": role}
    extra = extra if plane == "auto" else {"data_plane": plane, **extra}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return json.dumps(cfg)


# ----------------------------------------------------------------------------- HTTP seams: streams, metrics, timeline


def http_client(timeout: float) -> Any:
    """An httpx client with TCP_NODELAY, as a latency-sensitive client (and pdserve's own legs) would use."""
    import httpx

    return httpx.Client(timeout=timeout, transport=httpx.HTTPTransport(
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]))


def sse_data(client: Any, url: str, body: dict, headers: dict[str, str] | None = None) -> Iterator[tuple[float, str]]:
    """POST a streamed request to url; yield (arrival time, payload) of every SSE data line up to [DONE]."""
    with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if line.startswith("data: "):
                if line[6:] == "[DONE]":
                    break
                yield time.monotonic(), line[6:]


def stream_first(client: Any, url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[float, str]:
    """POST a streamed completion or chat; (monotonic time of the first token's chunk, the whole text). A chat's
    opening role chunk (no content, no logprobs) carries no token."""
    first_t, text = None, []
    for t, data in sse_data(client, url, body, headers):
        chunk = json.loads(data)
        if "choices" not in chunk:
            raise RuntimeError(f"{url}: error in stream: {data[:500]}")
        for ch in chunk["choices"][:1]:
            text.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
            if first_t is None and (text[-1] or ch.get("logprobs") or ch.get("finish_reason")):
                first_t = t
    if first_t is None:
        raise RuntimeError(f"{url}: the stream had no token")
    return first_t, "".join(text)


def scrape(client: Any, url: str) -> dict[str, float]:
    """/metrics as {name or name|label=value: value}, histogram buckets and _created samples dropped."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "le")}
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(labels.items()))
            out[key] = out.get(key, 0.0) + s.value
    return out


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


HELD = ("pdserve:num_requests_held", "pdserve:kv_leases_held", "pdserve:kv_push_expected")


def settle(client: Any, urls: dict[str, str], before: dict[str, dict[str, float]], insts: list[str],
           gw: str | None) -> dict[str, dict[str, float]]:
    """Metrics of every process in `before` once the request is over everywhere: P frees after read-done or
    write-done and the gateway counts the request after the stream, so the next request cannot overlap this
    one's tail (gives up after 5 s and returns what it has)."""
    deadline = time.monotonic() + 5
    while True:
        after = {n: scrape(client, urls[n]) for n in before}
        settled = all(after[n].get(k, 0) == 0 for n in insts for k in HELD)
        if gw:
            settled = settled and sum(delta(after[gw], before[gw], k) for k in after[gw]
                                      if k.startswith("pdserve:gateway_requests_total")) >= 1
        if settled or time.monotonic() > deadline:
            return after
        time.sleep(0.005)


def leg_means(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """The gateway's mean seconds per leg over the requests between two scrapes (pdserve:gateway_leg_seconds)."""
    out = {}
    for leg in ("prefill", "kv_ready", "decode_first_token"):
        n = delta(after, before, f"pdserve:gateway_leg_seconds_count|leg={leg}")
        if n:
            out[f"gw_{leg}"] = delta(after, before, f"pdserve:gateway_leg_seconds_sum|leg={leg}") / n
    return out


def timeline_events(client: Any, url: str, request_id: str) -> list[tuple[str, float, dict[str, Any]]]:
    """(event name, wall-clock seconds, attrs) of every timeline a process kept for one client request id, in time
    order; empty when the process has none (too old, or a pdserve without timelines)."""
    r = client.get(f"{url}/v1/timeline/{request_id}")
    if r.status_code != 200:
        return []
    events = [(e["name"], e["time_ns"] / 1e9, e.get("attrs") or {})
              for tl in r.json().get("data", []) for e in tl.get("events", [])]
    return sorted(events, key=lambda e: e[1])


def first_event(events: list[tuple[str, float, dict[str, Any]]], name: str) -> float:
    return next((t for n, t, _ in events if n == name), float("nan"))
