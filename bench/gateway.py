"""Gateway overhead: pdserve gateway vs vllm-router vs sglang-router vs a direct call, side by side.

Two stub backends (bench/stub_backend.py; P and D, one process each) answer instantly, so what is left is the
router's own cost. For every target, in rounds, interleaved (the order rotates each round):

* c32:    wrk -t1 -c32 (after a warm-up), POST /v1/completions with a ~110-byte JSON body, non-streaming. The
          figure of merit is the router's CPU-µs per proxied request: utime+stime of the router's process tree
          (/proc/<pid>/stat) over the run divided by the requests wrk completed (req/s mostly measures the
          box).
* c1:     wrk -t1 -c1: unloaded p50 / p99, and added p50 = target p50 - direct p50 (same round).
* stream: the c32 run with "stream": true (pdserve, vllm-router and direct).
* idle:   every router's CPU over an idle window as long as a c32 run (pdserve scrapes /metrics every 0.2 s
          and probes /health every 1 s). "net" µs/req subtracts that idle rate over the run's wall time; "raw"
          does not.

Each run records the cores other processes used (box busy time minus everything this benchmark started): above
~0.3 cores the req/s and latency figures are suspect; the CPU-µs figures hold up better.

    .venv/bin/python bench/gateway.py --quick
    .venv/bin/python bench/gateway.py --rounds 3 --json /tmp/gateway.json
    .venv/bin/python bench/gateway.py --targets direct,pdserve --profile /tmp/gw-prof  # + py-spy and perf

vllm-router and sglang-router are pip-installed into .cache/peers/{vllm-router,sglang-router} (reused when
there). Targets (from ../shared/docs/reference/peer-routers.md): pdserve CPU per request <= 2x
vllm-router's and <= 290 µs; pdserve added p50 at c=1 <= 0.6 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import routers as R  # noqa: E402

BODY = (b'{"model":"stub","prompt":"The quick brown fox jumps over the lazy dog.","max_tokens":4,'
        b'"temperature":0,"seed":1}')
STREAM_BODY = BODY[:-1] + b',"stream":true}'
ALL_TARGETS = ("direct", "pdserve", "vllm-router", "sglang-router")
STREAM_TARGETS = ("direct", "pdserve", "vllm-router")
DECODE_TEXT = " a b c d"  # what the stub's decode answer says

TARGET_CPU_RATIO = 2.0  # pdserve CPU/req <= 2x vllm-router's
TARGET_CPU_US = 290.0
TARGET_ADDED_P50_MS = 0.6


def median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


# ----------------------------------------------------------------------------- one measured run


class Bench:
    def __init__(self, wrk: str, stubs: list[R.Proc], routers: dict[str, R.Proc],
                 scripts: dict[str, Path]) -> None:
        self.wrk = wrk
        self.stubs = stubs  # [P, D]
        self.routers = routers  # target name -> process (direct has none)
        self.scripts = scripts
        self.procs = [*stubs, *routers.values()]

    def _snapshot(self) -> tuple[float, float, float, dict[str, float], dict[str, float], dict[str, float]]:
        t = os.times()
        return (time.monotonic(), R.box_busy_seconds(), t.user + t.system,
                {p.name: p.cpu() for p in self.procs}, {p.name: p.sched() for p in self.procs},
                {p.name: p.sys() for p in self.procs})

    def run(self, target: str, url: str, kind: str, conns: int, seconds: float) -> dict[str, Any]:
        for p in self.procs:
            p.refresh_tree()
        t0, box0, self0, cpu0, sched0, sys0 = self._snapshot()
        res, wrk_cpu = R.run_wrk(self.wrk, url, self.scripts[kind], conns, seconds)
        t1, box1, self1, cpu1, sched1, sys1 = self._snapshot()
        wall = t1 - t0
        delta = {name: cpu1[name] - cpu0[name] for name in cpu0}
        n = max(res["requests"], 1)
        ours = sum(delta.values()) + wrk_cpu + (self1 - self0)
        router = self.routers.get(target)
        router_cpu = delta[router.name] if router is not None else float("nan")
        router_sched = sched1[router.name] - sched0[router.name] if router is not None else float("nan")
        router_sys = sys1[router.name] - sys0[router.name] if router is not None else float("nan")
        p_name, d_name = self.stubs[0].name, self.stubs[1].name
        errors = res["connect"] + res["read"] + res["write"] + res["timeout"]
        return {
            "target": target, "kind": kind, "conns": conns, "wall_s": wall, "requests": res["requests"],
            "rps": res["requests"] / max(res["duration_us"] / 1e6, 1e-9), "non2xx": res["non2xx"],
            "socket_errors": errors, "p50_ms": res["p50_us"] / 1e3, "p90_ms": res["p90_us"] / 1e3,
            "p99_ms": res["p99_us"] / 1e3, "mean_ms": res["mean_us"] / 1e3, "max_ms": res["max_us"] / 1e3,
            "router_cpu_s": router_cpu, "router_us_per_req": router_cpu / n * 1e6,
            "router_core_pct": router_cpu / wall * 100, "router_sched_us_per_req": router_sched / n * 1e6,
            "router_sys_us_per_req": router_sys / n * 1e6,
            "p_us_per_req": delta[p_name] / n * 1e6, "d_us_per_req": delta[d_name] / n * 1e6,
            "wrk_core_pct": wrk_cpu / wall * 100, "others_cores": max((box1 - box0) - ours, 0.0) / wall,
            "idle_routers_cpu_s": {name: delta[p.name] for name, p in self.routers.items() if name != target},
        }

    def idle(self, seconds: float) -> dict[str, Any]:
        """Every process's CPU over an idle window (no load from us): background work (scrapes, probes)."""
        for p in self.procs:
            p.refresh_tree()
        t0, box0, self0, cpu0, sched0, _ = self._snapshot()
        time.sleep(seconds)
        t1, box1, self1, cpu1, sched1, _ = self._snapshot()
        wall = t1 - t0
        delta = {name: cpu1[name] - cpu0[name] for name in cpu0}
        ours = sum(delta.values()) + (self1 - self0)
        return {"wall_s": wall, "cores": {name: d / wall for name, d in delta.items()},
                "sched_cores": {name: (sched1[name] - sched0[name]) / wall for name in sched0},
                "others_cores": max((box1 - box0) - ours, 0.0) / wall}


# ----------------------------------------------------------------------------- checks before measuring


def sanity(name: str, url: str, streaming: bool) -> list[str]:
    """One request of each kind: 200 and D's answer (not P's one-token answer) must come back."""
    problems = []
    status, data, _ = R.post(url, "/v1/completions", BODY)
    if status != 200:
        problems.append(f"{name}: non-stream answered {status}: {data[:300]!r}")
    else:
        try:
            text = json.loads(data)["choices"][0]["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            text = None
        if text != DECODE_TEXT:
            problems.append(f"{name}: non-stream answer is not D's: {data[:300]!r}")
    if streaming:
        status, data, headers = R.post(url, "/v1/completions", STREAM_BODY)
        content_type = headers.get("content-type", "")
        if status != 200 or b"data: [DONE]" not in data or "event-stream" not in content_type:
            problems.append(f"{name}: stream answered {status} {headers.get('content-type')}: {data[:300]!r}")
    return problems


# ----------------------------------------------------------------------------- summary


def summarize(runs: list[dict[str, Any]], idles: list[dict[str, Any]], targets: list[str]) -> dict[str, Any]:
    by = defaultdict(list)
    for r in runs:
        by[(r["target"], r["kind"])].append(r)
    # idle rate per router per round (cores), to subtract over each run's wall time
    idle_by_round = [i["sched_cores"] for i in idles]  # ns-resolution; utime+stime has 10 ms ticks
    summary: dict[str, Any] = {"rows": {}, "idle": {}}
    for (target, kind), rs in by.items():
        net = []
        for r in rs:
            rate = idle_by_round[r["round"]].get(target) if r["round"] < len(idle_by_round) else None
            if rate is None or r["router_cpu_s"] != r["router_cpu_s"]:
                net.append(float("nan"))
            else:
                net.append((r["router_cpu_s"] - rate * r["wall_s"]) / max(r["requests"], 1) * 1e6)
        row = {k: median([r[k] for r in rs]) for k in ("rps", "p50_ms", "p99_ms", "router_us_per_req",
                                                        "router_sched_us_per_req", "router_sys_us_per_req",
                                                        "router_core_pct", "p_us_per_req", "d_us_per_req",
                                                        "wrk_core_pct", "others_cores")}
        cpu = [r["router_us_per_req"] for r in rs if r["router_us_per_req"] == r["router_us_per_req"]]
        row["router_us_min"] = min(cpu) if cpu else float("nan")
        row["router_us_max"] = max(cpu) if cpu else float("nan")
        row["router_us_net"] = median(net)
        row["rps_min"] = min(r["rps"] for r in rs)
        row["rps_max"] = max(r["rps"] for r in rs)
        row["rounds"] = len(rs)
        row["errors"] = sum(r["non2xx"] + r["socket_errors"] for r in rs)
        if kind == "c1":
            added = []
            for r in rs:
                d = [x for x in by.get(("direct", "c1"), []) if x["round"] == r["round"]]
                if d:
                    added.append(r["p50_ms"] - d[0]["p50_ms"])
            row["added_p50_ms"] = median(added)
            row["added_p50_ms_all"] = added
        summary["rows"][f"{target}/{kind}"] = row
    for name in [*targets, "stub-P", "stub-D"]:
        rates = [i["sched_cores"][name] for i in idles if name in i["sched_cores"]]
        ticks = [i["cores"][name] for i in idles if name in i["cores"]]
        if rates:
            summary["idle"][name] = {"core_pct": median(rates) * 100, "all_pct": [x * 100 for x in rates],
                                     "stat_core_pct": median(ticks) * 100}
    summary["idle_others_cores"] = median([i["others_cores"] for i in idles])
    return summary


def fmt(x: float, spec: str = ".0f") -> str:
    return "–" if x != x else format(x, spec)


def print_tables(summary: dict[str, Any], targets: list[str]) -> list[dict[str, Any]]:
    rows = summary["rows"]
    print("\n## c=32, non-streaming (wrk -t1 -c32; medians over rounds)")
    print("| target | req/s (min..max) | router CPU µs/req raw (min..max) | net of idle | schedstat "
          "| of it kernel | router % core | P µs/req | D µs/req | p50 ms | p99 ms | errors | others cores |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for t in targets:
        r = rows.get(f"{t}/c32")
        if r:
            print(f"| {t} | {r['rps']:.0f} ({r['rps_min']:.0f}..{r['rps_max']:.0f}) | "
                  f"**{fmt(r['router_us_per_req'])}** "
                  f"({fmt(r['router_us_min'])}..{fmt(r['router_us_max'])}) | {fmt(r['router_us_net'])} | "
                  f"{fmt(r['router_sched_us_per_req'])} | {fmt(r['router_sys_us_per_req'])} | "
                  f"{fmt(r['router_core_pct'])} | "
                  f"{r['p_us_per_req']:.0f} | "
                  f"{r['d_us_per_req']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} | "
                  f"{r['others_cores']:.2f} |")
    if any(f"{t}/c1" in rows for t in targets):
        print("\n## c=1 (wrk -t1 -c1): unloaded latency; added p50 = target p50 - direct p50 (same round)")
        print("| target | req/s | p50 ms | p99 ms | added p50 ms (per round) | router CPU µs/req | errors | "
              "others cores |")
        print("|---|---|---|---|---|---|---|---|")
    for t in targets:
        r = rows.get(f"{t}/c1")
        if r:
            per_round = ", ".join(f"{x:.3f}" for x in r.get("added_p50_ms_all", []))
            print(f"| {t} | {r['rps']:.0f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
                  f"**{fmt(r['added_p50_ms'], '.3f')}** ({per_round}) | {fmt(r['router_us_per_req'])} | "
                  f"{r['errors']} | {r['others_cores']:.2f} |")
    if any(f"{t}/stream" in rows for t in targets):
        print("\n## c=32, streaming (\"stream\": true; SSE from D)")
        print("| target | req/s | router CPU µs/req raw (min..max) | net of idle | P µs/req | D µs/req | "
              "p50 ms | p99 ms | errors | others cores |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for t in targets:
            r = rows.get(f"{t}/stream")
            if r:
                print(f"| {t} | {r['rps']:.0f} | **{fmt(r['router_us_per_req'])}** "
                      f"({fmt(r['router_us_min'])}..{fmt(r['router_us_max'])}) | {fmt(r['router_us_net'])} | "
                      f"{r['p_us_per_req']:.0f} | "
                      f"{r['d_us_per_req']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} | "
                      f"{r['others_cores']:.2f} |")
    if summary["idle"]:
        print("\n## idle background CPU (no load; window as long as a c32 run; schedstat, ns resolution)")
        print("| process | % of a core (median) | per round | utime+stime % (10 ms ticks) | "
              "= µs per request at its c32 rate |")
        print("|---|---|---|---|---|")
        for name, v in summary["idle"].items():
            r = rows.get(f"{name}/c32")
            per_req = v["core_pct"] / 100 / r["rps"] * 1e6 if r and r["rps"] else float("nan")
            print(f"| {name} | {v['core_pct']:.3f} | {', '.join(f'{x:.3f}' for x in v['all_pct'])} | "
                  f"{v['stat_core_pct']:.2f} | {fmt(per_req, '.1f')} |")
    return check_targets(summary)


def check_targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    rows = summary["rows"]
    pd, vr, sg = rows.get("pdserve/c32"), rows.get("vllm-router/c32"), rows.get("sglang-router/c32")
    pd1 = rows.get("pdserve/c1")
    checks = []
    print("\n## ratios and targets")
    if pd and vr:
        for label, key in (("raw", "router_us_per_req"), ("net of idle", "router_us_net")):
            ratio = pd[key] / vr[key]
            checks.append({"check": f"pdserve / vllm-router CPU µs/req at c=32 ({label})", "value": ratio,
                           "target": f"<= {TARGET_CPU_RATIO}", "pass": ratio <= TARGET_CPU_RATIO})
    if pd and sg:
        ratio = pd["router_us_per_req"] / sg["router_us_per_req"]
        checks.append({"check": "pdserve / sglang-router CPU µs/req at c=32 (raw; info only)", "value": ratio,
                       "target": "–", "pass": None})
    if pd:
        checks.append({"check": "pdserve CPU µs/req at c=32 (raw)", "value": pd["router_us_per_req"],
                       "target": f"<= {TARGET_CPU_US:.0f}", "pass": pd["router_us_per_req"] <= TARGET_CPU_US})
        checks.append({"check": "pdserve CPU µs/req at c=32 (net of idle)", "value": pd["router_us_net"],
                       "target": f"<= {TARGET_CPU_US:.0f}", "pass": pd["router_us_net"] <= TARGET_CPU_US})
        checks.append({"check": "pdserve errors (non-2xx + socket)", "value": pd["errors"], "target": "0",
                       "pass": pd["errors"] == 0})
    if pd1:
        checks.append({"check": "pdserve added p50 at c=1 (ms)", "value": pd1["added_p50_ms"],
                       "target": f"<= {TARGET_ADDED_P50_MS}",
                       "pass": pd1["added_p50_ms"] <= TARGET_ADDED_P50_MS})
    vr1 = rows.get("vllm-router/c1")
    if pd1 and vr1:
        checks.append({"check": "pdserve - vllm-router added p50 at c=1 (ms; info only)",
                       "value": pd1["added_p50_ms"] - vr1["added_p50_ms"], "target": "–", "pass": None})
    pds, vrs = rows.get("pdserve/stream"), rows.get("vllm-router/stream")
    if pds and vrs:
        checks.append({"check": "pdserve / vllm-router CPU µs/req, streaming c=32 (raw; info only)",
                       "value": pds["router_us_per_req"] / vrs["router_us_per_req"], "target": "–",
                       "pass": None})
    print("| check | value | target | result |")
    print("|---|---|---|---|")
    for c in checks:
        result = "–" if c["pass"] is None else ("PASS" if c["pass"] else "MISS")
        print(f"| {c['check']} | {c['value']:.2f} | {c['target']} | {result} |")
    return checks


# ----------------------------------------------------------------------------- profiling (pdserve alone)


def profile_pdserve(bench: Bench, url: str, pid: int, out: Path, seconds: int, conns: int) -> None:
    """py-spy the gateway under wrk -c`conns`: Python-level samples (--nonblocking: the process is never
    paused) for the tables, then a --native flame graph (pauses it for every sample, which over-weights
    syscalls such as write(); read kernel vs user time from /proc instead). Then perf_profile."""
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.access(pyspy, os.X_OK):
        print(f"py-spy not found: {Path(sys.executable).parent / 'pip'} install py-spy")
        return
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "pdserve-gateway.txt"
    svg = out / "pdserve-gateway-native.svg"
    passes = (("raw", raw, ["--nonblocking"]), ("flamegraph", svg, ["--native"]))
    results = {}
    for fmt_, path, flags in passes:
        rec = subprocess.Popen([pyspy, "record", *flags, "--rate", "500", "-d", str(seconds + 1), "-f", fmt_,
                                "-o", str(path), "--pid", str(pid)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            time.sleep(0.5)
            results[fmt_] = bench.run("pdserve", url, "c32", conns, seconds)
            rec.wait(seconds + 30)
        finally:
            if rec.poll() is None:
                rec.kill()
                rec.wait()
        log = rec.stdout.read().decode(errors="replace")
        rec.stdout.close()
        if rec.returncode != 0:
            print(f"py-spy ({fmt_}, {flags}) failed: {log[-1500:]}")
            if fmt_ == "raw":
                return
    r = results["raw"]
    print(f"\n## profile of the pdserve gateway under wrk -c{conns} ({seconds} s, py-spy --nonblocking at "
          f"500 Hz: {r['router_us_per_req']:.0f} µs/req of which kernel {r['router_sys_us_per_req']:.0f}, "
          f"{r['rps']:.0f} req/s)")
    print_profile(raw, r["router_us_per_req"], r["router_sys_us_per_req"])
    print(f"\ncollapsed stacks: {raw}\nnative flame graph: {svg}")
    perf_profile(bench, url, pid, out, seconds, conns)


def _frame_name(frame: str) -> str:
    # py-spy raw frames look like "function (path/to/file.py:123)"; keep function and file:line short
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    for prefix in (str(R.ROOT) + "/", "/root/.pyenv/versions/3.11.7/lib/python3.11/"):
        where = where.replace(prefix, "")
    if "site-packages/" in where:
        where = where.split("site-packages/", 1)[1]
    return f"{name} ({where})" if where else name


def _func_key(frame: str) -> str:
    """Function identity without the line number (inclusive time per function, not per line)."""
    name = _frame_name(frame)
    if "(" in name and ":" in name:
        head, _, tail = name.rpartition(":")
        return head + ")"
    return name


_WRITE_LINES: dict[str, bool] = {}


def _is_write_line(frame: str) -> bool:
    """Is this py-spy frame ("func (file:line)") a transport.write call? There the thread is in send() and, on
    this 2-core box, often preempted by the peer it just woke, so wall-clock samples over-weight it."""
    if frame not in _WRITE_LINES:
        _, _, where = frame.rpartition(" (")
        path, _, line = where.rstrip(")").rpartition(":")
        text = ""
        for base in (R.ROOT, *(Path(p) for p in sys.path if p)):  # py-spy shortens paths below sys.path
            try:
                text = (base / path).read_text().splitlines()[int(line) - 1]
                break
            except (OSError, ValueError, IndexError):
                continue
        _WRITE_LINES[frame] = "transport.write(" in text
    return _WRITE_LINES[frame]


def print_profile(raw: Path, us_per_req: float, sys_us_per_req: float, top: int = 25) -> None:
    """Tables from py-spy's collapsed stacks. py-spy samples wall-clock time of a busy thread, not CPU time:
    the samples whose leaf is a transport.write line are shown apart, and the rest are scaled to user CPU per
    request (router CPU µs/req minus kernel µs/req, both from /proc)."""
    self_time: Counter = Counter()
    incl: Counter = Counter()
    total = writes = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        frames = [f for f in stack.split(";") if f]
        if not frames:
            continue
        total += n
        if _is_write_line(frames[-1]):
            writes += n
            continue
        self_time[_frame_name(frames[-1])] += n
        for key in {_func_key(f) for f in frames[1:]}:  # frames[0] is the thread name
            incl[key] += n
    rest = total - writes
    if not rest:
        print("(no samples)")
        return
    user = us_per_req - sys_us_per_req
    print(f"{total} samples; {100 * writes / total:.1f}% at transport.write lines (send() plus waiting for "
          f"the CPU after waking the peer; the kernel's share of CPU is {sys_us_per_req:.0f} µs/req by "
          f"/proc). The other {rest} samples are scaled to user CPU: '≈µs/req' = share × {user:.0f} µs/req.")
    print(f"\n### top {top} lines by self time (C calls count in their Python caller)")
    print("| self % | ≈µs/req | frame |")
    print("|---|---|---|")
    for name, n in self_time.most_common(top):
        print(f"| {100 * n / rest:.1f} | {user * n / rest:.1f} | `{name}` |")
    print(f"\n### top {top} functions by inclusive time")
    print("| incl % | ≈µs/req | function |")
    print("|---|---|---|")
    for name, n in incl.most_common(top):
        print(f"| {100 * n / rest:.1f} | {user * n / rest:.1f} | `{name}` |")


def perf_profile(bench: Bench, url: str, pid: int, out: Path, seconds: int, conns: int) -> None:
    """On-CPU samples (kernel included) with perf, by shared object and by symbol: where CPU goes below Python
    (interpreter, GC, uvloop, httptools, msgspec, kernel TCP)."""
    perf = shutil.which("perf")
    if not perf:
        print("perf not found (apt-get install -y linux-perf): skipping the native on-CPU profile")
        return
    data = out / "pdserve-gateway.perf.data"
    rec = subprocess.Popen([perf, "record", "-F", "997", "-e", "cpu-clock", "-p", str(pid), "-o", str(data),
                            "--", "sleep", str(seconds + 1)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        time.sleep(0.5)
        r = bench.run("pdserve", url, "c32", conns, seconds)
        rec.wait(seconds + 30)
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
    log = rec.stdout.read().decode(errors="replace")
    rec.stdout.close()
    if rec.returncode != 0:
        print(f"perf record failed: {log[-1000:]}")
        return
    us = r["router_us_per_req"]
    print(f"\n## on-CPU profile (perf, cpu-clock at 997 Hz) under wrk -c{conns}: {us:.0f} µs/req "
          f"(kernel {r['router_sys_us_per_req']:.0f}), {r['rps']:.0f} req/s; '≈µs/req' = share × {us:.0f}")
    for sort, top in (("dso", 10), ("sym", 30)):
        rep = subprocess.run([perf, "report", "-i", str(data), "--no-children", "--sort", sort, "-g", "none",
                              "--stdio"], capture_output=True, text=True)
        rows = []
        for line in rep.stdout.splitlines():
            line = line.strip()
            if not line or line.startswith("#") or "%" not in line.split()[0]:
                continue
            pct, name = line.split(None, 1)
            rows.append((float(pct.rstrip("%")), " ".join(name.split())))
        print(f"\n### by {'shared object' if sort == 'dso' else 'symbol'} (top {top})")
        print("| % of samples | ≈µs/req | " + ("object" if sort == "dso" else "symbol") + " |")
        print("|---|---|---|")
        for pct, name in rows[:top]:
            print(f"| {pct:.1f} | {us * pct / 100:.1f} | `{name}` |")
    if rows:
        gc_syms = ("gc_collect", "visit_decref", "visit_reachable", "move_unreachable", "subtract_refs",
                   "update_refs")
        gc = sum(p for p, n in rows if any(k in n for k in gc_syms))
        print(f"\ncyclic GC symbols (gc_collect_main, visit_*, ...): {gc:.1f}% ≈ {us * gc / 100:.0f} µs/req")
    print(f"perf data: {data}")


# ----------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round, short runs (smoke test, ~1 min)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3; 1 with --quick)")
    ap.add_argument("--duration", type=int, default=None, help="s per c32 run (default 8; 3 with --quick)")
    ap.add_argument("--c1-duration", type=int, default=None, help="s per c1 run (default 5; 2 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="s of warm-up before each run (default 2; 1)")
    ap.add_argument("--targets", default=",".join(ALL_TARGETS),
                    help=f"comma list of {', '.join(ALL_TARGETS)}")
    ap.add_argument("--kinds", default="c32,c1,stream", help="which runs: c32, c1, stream")
    ap.add_argument("--no-idle", action="store_true", help="skip the idle-CPU window")
    ap.add_argument("--json", type=Path, help="write every run and the summary here")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="after the rounds, profile the pdserve gateway under c32 load (py-spy, perf)")
    ap.add_argument("--profile-seconds", type=int, default=10)
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    duration = args.duration or (3 if args.quick else 8)
    c1_duration = args.c1_duration or (2 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    targets = [t for t in args.targets.split(",") if t]
    kinds = [k for k in args.kinds.split(",") if k]
    bad = set(targets) - set(ALL_TARGETS) or set(kinds) - {"c32", "c1", "stream"}
    if bad:
        ap.error(f"unknown {sorted(bad)}")
    if "c1" in kinds and "direct" not in targets:
        print("note: without the direct target, added p50 cannot be computed")

    wrk = R.find_wrk()
    tmp = R.temp_dir()
    started: list[R.Proc] = []
    runs: list[dict[str, Any]] = []
    idles: list[dict[str, Any]] = []
    try:
        print(f"# gateway overhead benchmark  (load avg {R.loadavg()}, {os.cpu_count()} cores, "
              f"body {len(BODY)} B, stream body {len(STREAM_BODY)} B; rounds {rounds}, c32 {duration} s, "
              f"c1 {c1_duration} s, "
              f"warm-up {warmup} s)", flush=True)
        stub_p = R.start_stub("stub-P", "prefill", tmp)
        started.append(stub_p)
        stub_d = R.start_stub("stub-D", "decode", tmp)
        started.append(stub_d)
        routers: dict[str, R.Proc] = {}
        urls = {"direct": stub_d.url}
        starters = {"pdserve": lambda: R.start_pdserve(stub_p.url, stub_d.url, tmp, body=BODY),
                    "vllm-router": lambda: R.start_vllm_router(stub_p.url, stub_d.url, tmp, BODY),
                    "sglang-router": lambda: R.start_sglang_router(stub_p.url, stub_d.url, tmp, BODY)}
        for name in targets:
            if name in starters:
                t0 = time.monotonic()
                proc = starters[name]()
                started.append(proc)
                routers[name] = proc
                urls[name] = proc.url
                print(f"started {name}: pid {proc.pid} ({len(proc.tree)} processes) at {proc.url} in "
                      f"{time.monotonic() - t0:.1f} s", flush=True)
        problems = []
        for name in targets:
            problems += sanity(name, urls[name], streaming=name in STREAM_TARGETS and "stream" in kinds)
        if problems:
            for p in problems:
                print("SANITY:", p)
            return 1
        scripts = {"c32": R.write_wrk_script(tmp, "body", BODY), "c1": R.write_wrk_script(tmp, "body", BODY),
                   "stream": R.write_wrk_script(tmp, "stream", STREAM_BODY)}
        bench = Bench(wrk, [stub_p, stub_d], routers, scripts)
        plan = [("c32", 32, duration), ("c1", 1, c1_duration), ("stream", 32, duration)]
        for rnd in range(rounds):
            if not args.no_idle and routers:
                idle = bench.idle(duration)
                idle["round"] = rnd
                idles.append(idle)
                print(f"[round {rnd + 1}/{rounds}] idle: " + ", ".join(
                    f"{k} {v * 100:.2f}%" for k, v in idle["cores"].items()) +
                    f"; others {idle['others_cores']:.2f} cores", flush=True)
            for kind, conns, seconds in plan:
                if kind not in kinds:
                    continue
                names = [t for t in targets if kind != "stream" or t in STREAM_TARGETS]
                shift = rnd % len(names)
                for name in names[shift:] + names[:shift]:
                    if warmup:
                        R.run_wrk(wrk, urls[name], scripts[kind], conns, warmup)
                    r = bench.run(name, urls[name], kind, conns, seconds)
                    r["round"] = rnd
                    runs.append(r)
                    flag = "" if r["non2xx"] == 0 and r["socket_errors"] == 0 else \
                        f"  ERRORS non2xx={r['non2xx']} socket={r['socket_errors']}"
                    print(f"[round {rnd + 1}/{rounds}] {kind:6s} {name:13s} {r['rps']:7.0f} req/s  "
                          f"router {fmt(r['router_us_per_req']):>5s} µs/req "
                          f"({fmt(r['router_core_pct'])}% core)  P {r['p_us_per_req']:.0f} "
                          f"D {r['d_us_per_req']:.0f} µs/req  p50 {r['p50_ms']:.3f} "
                          f"p99 {r['p99_ms']:.3f} ms  others {r['others_cores']:.2f}{flag}", flush=True)
        for proc in started:
            if not proc.alive():
                print(f"WARNING: {proc.name} died during the run: {proc.log_tail()}")
        summary = summarize(runs, idles, targets)
        checks = print_tables(summary, targets)
        if args.profile and "pdserve" in routers:
            profile_pdserve(bench, urls["pdserve"], routers["pdserve"].pid, args.profile,
                            args.profile_seconds, 32)
        print(f"\nload avg at the end: {R.loadavg()}")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"config": {"rounds": rounds, "duration_s": duration,
                                                        "c1_duration_s": c1_duration, "warmup_s": warmup,
                                                        "targets": targets, "kinds": kinds,
                                                        "body_bytes": len(BODY), "cores": os.cpu_count()},
                                             "runs": runs, "idle": idles, "summary": summary,
                                             "checks": checks},
                                            indent=1, default=str))
            print(f"wrote {args.json}")
        return 0
    finally:
        for proc in reversed(started):
            try:
                proc.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                print(f"could not stop {proc.name} ({proc.pid}): {exc}")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
