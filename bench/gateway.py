"""Gateway overhead: pdserve gateway vs vllm-router vs sglang-router vs a direct call, side by side.

Two stub backends (bench/stub_backend.py; P and D, one process each) answer instantly, so what is left is the
router's own cost. They answer like vLLM 0.32 NixlConnector instances (`--instances vllm`) or like pdserve
instances (`--instances pdserve`: pdserve's info endpoint, KV parameters and response headers); with both (the
default) each kind gets its own stubs and routers, one after the other. For every target, in rounds, interleaved
(the order rotates each round):

* c32:    wrk -t1 -c32 (after a warm-up), POST /v1/completions with a ~110-byte JSON body, non-streaming. The
          figure of merit is the router's CPU-us per proxied request: utime+stime of the router's process tree
          (/proc/<pid>/stat) over the run divided by the requests wrk completed (req/s mostly measures the box).
* c1:     wrk -t1 -c1: unloaded p50 / p99, added p50 = target p50 - direct p50 (same round), and CPU per request
          (which, at ~1-2k req/s, also carries the router's idle background work).
* stream: the c32 run with "stream": true (pdserve, vllm-router and direct).
* idle:   every router's CPU over an idle window as long as a c32 run (pdserve scrapes /metrics every 0.2 s and
          probes /health every 1 s), from schedstat (ns resolution). "net" us/req subtracts that idle rate.

Each run records the cores other processes used (box busy time minus everything this benchmark started): above
~0.3 cores the req/s and latency figures are suspect; the CPU-us figures hold up better.

    .venv/bin/python bench/gateway.py --quick                                  # smoke run (~1 min)
    .venv/bin/python bench/gateway.py --rounds 3 --json bench/out/gateway.json  # the table in docs/benchmarks.md
    .venv/bin/python bench/gateway.py --targets direct,pdserve --kinds c32      # pdserve alone
    .venv/bin/python bench/gateway.py --targets direct,pdserve --base DIR  # + DIR's pdserve (an older checkout)
    .venv/bin/python bench/gateway.py --targets direct,pdserve,vllm-router --kinds c32,c1 --rounds 3  # issue 24
    .venv/bin/python bench/gateway.py --targets pdserve --instances pdserve --protocol push --kinds c32

vllm-router and sglang-router are pip-installed into .cache/peers/{vllm-router,sglang-router} (reused when there).
`--protocol` (pull, push, decode-first) is the pdserve gateway's; vllm-router and sglang-router always run their
own pull. Targets: pdserve CPU per request <= 1x vllm-router's at c=32 and at c=1 (in front of either kind of
instance) and <= 290 us; pdserve added p50 at c=1 <= 0.6 ms.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import harness as H  # noqa: E402
from proc_cpu import box_busy_s, sched_seconds  # noqa: E402

BODY = (b'{"model":"stub","prompt":"The quick brown fox jumps over the lazy dog.","max_tokens":4,'
        b'"temperature":0,"seed":1}')
STREAM_BODY = BODY[:-1] + b',"stream":true}'
ALL_TARGETS = ("direct", "pdserve", "vllm-router", "sglang-router")
STREAM_TARGETS = ("direct", "pdserve", "pdserve-base", "vllm-router")
DECODE_TEXT = " a b c d"  # what the stub's decode answer says
PEERS_DIR = BENCH.parent / ".cache" / "peers"
TARGET_CPU_RATIO = 1.0  # pdserve CPU/req <= vllm-router's
TARGET_CPU_US = 290.0
# Every client request carries it; the pdserve gateway checks it (vllm-router has no client key to check).
API_KEY = "bench-key"
TARGET_ADDED_P50_MS = 0.6
WRK_LUA = """\
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRKJSON {{"requests":%d,"duration_us":%d,"errors":%d,"non2xx":%d,' ..
    '"p50_us":%d,"p99_us":%d}}\\n', summary.requests, summary.duration,
    e.connect + e.read + e.write + e.timeout, e.status, latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass
class Proc:
    """A stub or router this benchmark started (own session); `tree` is refreshed with its descendants."""

    name: str
    popen: subprocess.Popen
    url: str
    log_path: Path
    tree: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def refresh(self) -> None:
        if self.popen.poll() is None:
            self.tree = H.descendants(self.pid)

    def cpu(self) -> float:
        return sum(H.cpu_seconds(p) for p in self.tree or [self.pid])

    def sched(self) -> float:
        return sum(sched_seconds(p) for p in self.tree or [self.pid])

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL; then any descendant still alive, by PID."""
        self.refresh()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        for pid in self.tree[1:]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def post(url: str, body: bytes, timeout: float = 5.0) -> tuple[int, bytes, dict[str, str]]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json",
                                                       "authorization": f"Bearer {API_KEY}"})
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def spawn(name: str, cmd: list[str], work: Path, cleanup: H.Cleanup, ready_line: bool = False,
          port: int = 0, env: dict[str, str] | None = None, cwd: str | None = None) -> Proc:
    """Start a process and wait until it answers a completion (after its JSON ready line, if it prints one)."""
    log_path = work / f"{name}.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(cmd, stdout=subprocess.PIPE if ready_line else log, stderr=log,
                                 stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}, start_new_session=True,
                                 cwd=cwd)
    proc = Proc(name, popen, f"http://127.0.0.1:{port}", log_path)
    cleanup.add(proc.stop)
    if ready_line:
        line = b""
        while not line.startswith(b"{"):
            line = popen.stdout.readline()
            if not line and popen.poll() is not None:
                raise RuntimeError(f"{name} exited: {log_path.read_text()[-2000:]}")
        proc.url = f"http://127.0.0.1:{json.loads(line)['port']}"
        threading.Thread(target=popen.stdout.read, daemon=True).start()  # a full pipe must never block it
    deadline, last = time.monotonic() + 90, ""
    while time.monotonic() < deadline:  # sglang-router registers its workers after it listens
        if popen.poll() is not None:
            raise RuntimeError(f"{name} exited ({popen.returncode}): {log_path.read_text()[-2000:]}")
        try:
            status, data, _ = post(proc.url, BODY, timeout=2)
            if status == 200:
                proc.refresh()
                return proc
            last = f"{status} {data[:200]!r}"
        except OSError as exc:
            last = repr(exc)
        time.sleep(0.1)
    raise RuntimeError(f"{name} not serving within 90 s (last: {last})")


def peer_exe(name: str) -> str:
    """`.cache/peers/NAME` with the PyPI package NAME pip-installed (reused when its entry point is there)."""
    venv = PEERS_DIR / name
    exe = venv / "bin" / name
    if not exe.exists():
        PEERS_DIR.mkdir(parents=True, exist_ok=True)
        print(f"installing {name} into {venv} ...", flush=True)
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", name], check=True)
    return str(exe)


def start_stubs(instances: str, work: Path, cleanup: H.Cleanup) -> list[Proc]:
    """P and D stubs (bench/stub_backend.py) answering like `instances`: "vllm" or "pdserve"."""
    return [spawn(f"stub-{r[0].upper()}", [sys.executable, str(BENCH / "stub_backend.py"), "--port", "0", "--role", r,
                                           "--kind", instances], work, cleanup, ready_line=True)
            for r in ("prefill", "decode")]


def pdserve_gateway(launcher: list[str], p_url: str, d_url: str, work: Path, cleanup: H.Cleanup, root: str,
                    protocol: str = "pull", name: str = "pdserve") -> Proc:
    """`pdserve gateway` from the checkout `root` in front of P and D, everything on but tracing, run by `launcher`:
    the command that runs pdserve's CLI (`python -m pdserve`, or a profiler's wrapper of it)."""
    # `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH: each gateway runs in the
    # checkout it measures (from this one, the base would import this checkout's pdserve).
    return spawn(name, [*launcher, "gateway", "--prefill", p_url, "--decode", d_url, "--protocol", protocol,
                        "--scheduling", "batch", "--policy", "round_robin", "--api-key", API_KEY, "--host",
                        "127.0.0.1", "--port", "0", "--log-level", "warning"], work, cleanup, ready_line=True,
                 env={"PYTHONUNBUFFERED": "1", "PYTHONPATH": root}, cwd=root)


def write_wrk_script(path: Path, body: bytes = BODY) -> Path:
    """wrk's script: POST `body` to /v1/completions with the API key, and the summary as one JSON line."""
    path.write_text(WRK_LUA.format(body=json.dumps(body.decode()), key=API_KEY))
    return path


def start_target(name: str, p_url: str, d_url: str, work: Path, cleanup: H.Cleanup, base: str | None = None,
                 protocol: str = "pull") -> Proc:
    if name in ("pdserve", "pdserve-base"):
        root = base if name == "pdserve-base" else str(BENCH.parent)
        return pdserve_gateway([sys.executable, "-m", "pdserve"], p_url, d_url, work, cleanup, root, protocol, name)
    port, prom = H.free_port(), H.free_port()
    if name == "vllm-router":
        cmd = [peer_exe(name), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation", "--prefill",
               p_url, "--decode", d_url, "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(prom), "--log-level", "warning"]
    else:  # the bootstrap port is only copied into request bodies; nothing listens on it here
        cmd = [peer_exe(name), "launch", "--host", "127.0.0.1", "--port", str(port), "--pd-disaggregation",
               "--prefill", p_url, str(H.free_port()), "--decode", d_url, "--policy", "round_robin",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), "--log-level", "warn"]
    return spawn(name, cmd, work, cleanup, port=port, env={"HF_HUB_OFFLINE": "1"})


def sanity(name: str, url: str, streaming: bool) -> list[str]:
    """One request of each kind: 200 and D's answer (not P's one-token answer) must come back."""
    problems = []
    status, data, _ = post(url, BODY)
    try:
        ok = status == 200 and json.loads(data)["choices"][0]["text"] == DECODE_TEXT
    except (ValueError, KeyError, IndexError, TypeError):
        ok = False
    if not ok:
        problems.append(f"{name}: non-stream answer is not D's: {status} {data[:300]!r}")
    if streaming:
        status, data, headers = post(url, STREAM_BODY)
        if status != 200 or b"data: [DONE]" not in data or "event-stream" not in headers.get("content-type", ""):
            problems.append(f"{name}: stream answered {status} {headers.get('content-type')}: {data[:300]!r}")
    return problems


def run_wrk(url: str, script: Path, conns: int, seconds: float) -> tuple[dict[str, Any], float]:
    """wrk -t1 -cN; its summary (from the Lua `done`) and its own CPU seconds (from wait4)."""
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--timeout", "5s", "-s", str(script),
           url + "/v1/completions"]
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    out = popen.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(popen.pid, 0)
    popen.returncode = os.waitstatus_to_exitcode(status)
    popen.stdout.close()
    for line in out.splitlines():
        if line.startswith("WRKJSON "):
            return json.loads(line[8:]), usage.ru_utime + usage.ru_stime
    raise RuntimeError(f"wrk gave no summary (rc {popen.returncode}): {out[-2000:]}")


class Bench:
    def __init__(self, stubs: list[Proc], routers: dict[str, Proc], scripts: dict[str, Path]) -> None:
        self.stubs, self.routers, self.scripts = stubs, routers, scripts
        self.procs = [*stubs, *routers.values()]

    def _snapshot(self) -> tuple[float, float, float, dict[str, float], dict[str, float]]:
        t = os.times()
        return (time.monotonic(), box_busy_s(), t.user + t.system,
                {p.name: p.cpu() for p in self.procs}, {p.name: p.sched() for p in self.procs})

    def run(self, target: str, url: str, kind: str, conns: int, seconds: float) -> dict[str, Any]:
        for p in self.procs:
            p.refresh()
        t0, box0, self0, cpu0, _ = self._snapshot()
        res, wrk_cpu = run_wrk(url, self.scripts[kind], conns, seconds)
        t1, box1, self1, cpu1, _ = self._snapshot()
        wall, n = t1 - t0, max(res["requests"], 1)
        used = {name: cpu1[name] - cpu0[name] for name in cpu0}
        router = self.routers.get(target)
        router_cpu = used[router.name] if router is not None else float("nan")
        ours = sum(used.values()) + wrk_cpu + (self1 - self0)
        return {"target": target, "kind": kind, "wall_s": wall, "requests": res["requests"],
                "rps": res["requests"] / max(res["duration_us"] / 1e6, 1e-9), "errors": res["errors"] + res["non2xx"],
                "p50_ms": res["p50_us"] / 1e3, "p99_ms": res["p99_us"] / 1e3, "router_cpu_s": router_cpu,
                "router_us_per_req": router_cpu / n * 1e6, "p_us_per_req": used["stub-P"] / n * 1e6,
                "d_us_per_req": used["stub-D"] / n * 1e6, "others_cores": max((box1 - box0) - ours, 0.0) / wall}

    def idle(self, seconds: float) -> dict[str, Any]:
        """Every process's CPU over a window with no load from us: background work (scrapes, probes)."""
        for p in self.procs:
            p.refresh()
        t0, box0, self0, cpu0, sched0 = self._snapshot()
        time.sleep(seconds)
        t1, box1, self1, cpu1, sched1 = self._snapshot()
        wall = t1 - t0
        ours = sum(cpu1[n] - cpu0[n] for n in cpu0) + (self1 - self0)
        return {"wall_s": wall, "cores": {n: (sched1[n] - sched0[n]) / wall for n in sched0},
                "others_cores": max((box1 - box0) - ours, 0.0) / wall}


def summarize(runs: list[dict[str, Any]], idles: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        by[(r["target"], r["kind"])].append(r)
    rows: dict[str, Any] = {}
    for (target, kind), rs in by.items():
        row = {k: H.median([r[k] for r in rs if r[k] == r[k]]) for k in
               ("rps", "p50_ms", "p99_ms", "router_us_per_req", "p_us_per_req", "d_us_per_req", "others_cores")}
        cpu = [r["router_us_per_req"] for r in rs if r["router_us_per_req"] == r["router_us_per_req"]]
        row["router_us_min"], row["router_us_max"] = (min(cpu), max(cpu)) if cpu else (float("nan"),) * 2
        row["router_us_by_round"] = {r["round"]: r["router_us_per_req"] for r in rs}
        row["router_us_net"] = H.median([(r["router_cpu_s"] - idles[r["round"]]["cores"].get(target, 0) * r["wall_s"])
                                         / max(r["requests"], 1) * 1e6 for r in rs if r["round"] < len(idles)])
        row["errors"] = sum(r["errors"] for r in rs)
        if kind == "c1":
            direct = {x["round"]: x["p50_ms"] for x in by.get(("direct", "c1"), [])}
            row["added_p50_ms_all"] = [r["p50_ms"] - direct[r["round"]] for r in rs if r["round"] in direct]
            row["added_p50_ms"] = H.median(row["added_p50_ms_all"])
        rows[f"{target}/{kind}"] = row
    idle = {n: H.median([i["cores"][n] for i in idles]) * 100 for n in (idles[0]["cores"] if idles else {})}
    return {"rows": rows, "idle_core_pct": idle}


def print_tables(summary: dict[str, Any], targets: list[str]) -> list[dict[str, Any]]:
    rows = summary["rows"]
    for kind, title in (("c32", "c=32, non-streaming"), ("c1", "c=1: added p50 = target p50 - direct p50 (same round)"),
                        ("stream", "c=32, streaming")):
        if not any(f"{t}/{kind}" in rows for t in targets):
            continue
        print(f"\n## {title} (wrk -t1; medians over rounds)")
        print("| target | req/s | router CPU us/req (min..max) | net of idle | P us/req | D us/req | p50 ms | p99 ms | "
              "added p50 ms (per round) | errors | others cores |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for t in targets:
            r = rows.get(f"{t}/{kind}")
            if r:
                added = (f"**{H.fmt(r['added_p50_ms'], '.3f')}** ("
                         + ", ".join(f"{x:.3f}" for x in r["added_p50_ms_all"]) + ")") if kind == "c1" else "-"
                print(f"| {t} | {r['rps']:.0f} | **{H.fmt(r['router_us_per_req'], '.0f')}** "
                      f"({H.fmt(r['router_us_min'], '.0f')}..{H.fmt(r['router_us_max'], '.0f')}) | "
                      f"{H.fmt(r['router_us_net'], '.0f')} | {r['p_us_per_req']:.0f} | {r['d_us_per_req']:.0f} | "
                      f"{r['p50_ms']:.3f} | {r['p99_ms']:.2f} | {added} | {r['errors']} | {r['others_cores']:.2f} |")
    if summary["idle_core_pct"]:
        print("\n## idle background CPU (% of a core, median; schedstat): " + ", ".join(
            f"{n} {v:.3f}" for n, v in summary["idle_core_pct"].items()))
    return check_targets(rows)


def check_targets(rows: dict[str, Any]) -> list[dict[str, Any]]:
    pd, vr, sg, pd1, vr1, pds, vrs = (rows.get(f"{t}/{k}") for t, k in (
        ("pdserve", "c32"), ("vllm-router", "c32"), ("sglang-router", "c32"), ("pdserve", "c1"), ("vllm-router", "c1"),
        ("pdserve", "stream"), ("vllm-router", "stream")))
    checks: list[tuple[str, float, str, bool | None]] = []
    base = rows.get("pdserve-base/c32")
    if pd and base:  # a change's own cost: this checkout against the base one, same run
        ratio = pd["router_us_per_req"] / base["router_us_per_req"]
        checks.append(("pdserve / pdserve-base CPU us/req at c=32", ratio, "report", None))
    for kind, (ours, theirs) in (("c32", (pd, vr)), ("c1", (pd1, vr1))):
        if not (ours and theirs):
            continue
        for label, key in (("raw", "router_us_per_req"), ("net of idle", "router_us_net")):
            ratio = ours[key] / theirs[key]
            per_round = "" if label != "raw" else " (per round: " + ", ".join(
                f"{ours['router_us_by_round'][r] / theirs['router_us_by_round'][r]:.2f}"
                for r in sorted(ours["router_us_by_round"]) if r in theirs["router_us_by_round"]) + ")"
            checks.append((f"pdserve / vllm-router CPU us/req at c={kind[1:]} ({label}){per_round}", ratio,
                           f"<= {TARGET_CPU_RATIO}", ratio <= TARGET_CPU_RATIO))
    if pd and sg:
        checks.append(("pdserve / sglang-router CPU us/req at c=32 (info)",
                       pd["router_us_per_req"] / sg["router_us_per_req"], "-", None))
    if pd:
        checks.append(("pdserve CPU us/req at c=32 (raw)", pd["router_us_per_req"], f"<= {TARGET_CPU_US:.0f}",
                       pd["router_us_per_req"] <= TARGET_CPU_US))
        checks.append(("pdserve errors (non-2xx + socket)", pd["errors"], "0", pd["errors"] == 0))
    if pd1:
        checks.append(("pdserve added p50 at c=1 (ms)", pd1["added_p50_ms"], f"<= {TARGET_ADDED_P50_MS}",
                       pd1["added_p50_ms"] <= TARGET_ADDED_P50_MS))
    if pd1 and vr1:
        checks.append(("pdserve - vllm-router added p50 at c=1 (ms; info)",
                       pd1["added_p50_ms"] - vr1["added_p50_ms"], "-", None))
    if pds and vrs:
        checks.append(("pdserve / vllm-router CPU us/req, streaming c=32 (info)",
                       pds["router_us_per_req"] / vrs["router_us_per_req"], "-", None))
    print("\n## ratios and targets\n| check | value | target | result |\n|---|---|---|---|")
    for name, value, target, ok in checks:
        print(f"| {name} | {value:.2f} | {target} | {'-' if ok is None else 'PASS' if ok else 'MISS'} |")
    return [{"check": c, "value": v, "target": t, "pass": ok} for c, v, t, ok in checks]


def measure(instances: str, args: argparse.Namespace, targets: list[str], kinds: list[str], cleanup: H.Cleanup,
            work: Path) -> dict[str, Any] | None:
    """Stubs answering like `instances` (vllm or pdserve), every target in front of them, the rounds; None when a
    target failed its sanity check."""
    stubs = start_stubs(instances, work, cleanup)
    routers = {t: start_target(t, stubs[0].url, stubs[1].url, work, cleanup, args.base, args.protocol)
               for t in targets if t != "direct"}
    urls = {"direct": stubs[1].url, **{t: p.url for t, p in routers.items()}}
    problems = [p for t in targets for p in sanity(t, urls[t], t in STREAM_TARGETS and "stream" in kinds)]
    if problems:
        print("SANITY:\n  " + "\n  ".join(problems))
        return None
    scripts = {kind: write_wrk_script(work / f"{kind}.lua", body)
               for kind, body in (("c32", BODY), ("c1", BODY), ("stream", STREAM_BODY))}
    bench, runs, idles = Bench(stubs, routers, scripts), [], []
    for rnd in range(args.rounds):
        if not args.no_idle and routers:
            idles.append(bench.idle(args.duration))
            print(f"[{instances} round {rnd + 1}/{args.rounds}] idle: " + ", ".join(
                f"{k} {v * 100:.2f}%" for k, v in idles[-1]["cores"].items()), flush=True)
        for kind, conns, seconds in (("c32", 32, args.duration), ("c1", 1, args.c1_duration),
                                     ("stream", 32, args.duration)):
            names = [t for t in targets if kind in kinds and (kind != "stream" or t in STREAM_TARGETS)]
            for name in names[rnd % max(len(names), 1):] + names[:rnd % max(len(names), 1)]:
                if args.warmup:
                    run_wrk(urls[name], scripts[kind], conns, args.warmup)
                runs.append({**bench.run(name, urls[name], kind, conns, seconds), "round": rnd})
                r = runs[-1]
                print(f"[{instances} round {rnd + 1}/{args.rounds}] {kind:6s} {name:13s} {r['rps']:7.0f} req/s  "
                      f"router {H.fmt(r['router_us_per_req'], '.0f'):>5s} us/req  p50 {r['p50_ms']:.3f} p99 "
                      f"{r['p99_ms']:.3f} ms  errors {r['errors']}  others {r['others_cores']:.2f}", flush=True)
    summary = summarize(runs, idles)
    print(f"\n# in front of {instances}-like instances (pdserve --protocol {args.protocol})")
    checks = print_tables(summary, targets)
    if args.profile and "pdserve" in routers:
        profile_router(routers["pdserve"], urls["pdserve"], scripts, Path(args.profile) / f"{instances}-{args.protocol}",
                       args.duration)
    for proc in [*routers.values(), *stubs]:
        proc.stop()
    return {"runs": runs, "idle": idles, "summary": summary, "checks": checks}


def profile_router(router: Proc, url: str, scripts: dict[str, Path], out: Path, seconds: int) -> None:
    """py-spy (sampling, Python frames) on the router during one more c32 and c1 run, not measured: the collapsed
    stacks go to OUT-c32.txt / OUT-c1.txt, and the share of samples by part of the path is printed. py-spy 0.3.14
    (0.4.x does not find this Python's version; `--native` fails to merge uvloop's frames). Under asyncio on
    Python 3.11 it charges time spent in the event loop's C code to the last Python line that ran (a socket
    write, typically), so the parts are a map of the path, not a cost account: measure a change's cost by A/B."""
    import pyspy_summary

    out.parent.mkdir(parents=True, exist_ok=True)
    for kind, conns in (("c32", 32), ("c1", 1)):
        path = out.parent / f"{out.name}-{kind}.txt"
        spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(router.pid),
                                "--rate", "250", "--format", "raw", "--output", str(path),
                                "--duration", str(seconds + 1)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(0.5)
        run_wrk(url, scripts[kind], conns, seconds)
        spy.wait(30)
        print(f"\n## profile of the pdserve gateway, {kind} ({path})")
        if path.exists():
            pyspy_summary.report(path)
        else:
            print("py-spy wrote nothing (is it py-spy 0.3.14, run as root?)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round, short runs (smoke test, ~1 min)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3; 1 with --quick; 0 with --profile)")
    ap.add_argument("--duration", type=int, default=None, help="s per c32 run (default 8; 3 with --quick)")
    ap.add_argument("--c1-duration", type=int, default=None, help="s per c1 run (default 5; 2 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="s of warm-up before each run (default 2; 1)")
    ap.add_argument("--targets", default=",".join(ALL_TARGETS), help=f"comma list of {', '.join(ALL_TARGETS)}")
    ap.add_argument("--kinds", default="c32,c1,stream", help="which runs: c32, c1, stream")
    ap.add_argument("--instances", default="vllm,pdserve", help="what the stubs answer like: vllm, pdserve or both")
    ap.add_argument("--protocol", default="pull", choices=["pull", "push", "decode-first"],
                    help="the pdserve gateway's protocol (the peer routers run their pull)")
    ap.add_argument("--profile", metavar="DIR", help="then py-spy the pdserve gateway (one c32 and one c1 run)")
    ap.add_argument("--no-idle", action="store_true", help="skip the idle-CPU window")
    ap.add_argument("--json", help="write every run and the summary here")
    ap.add_argument("--base", help="another checkout whose pdserve gateway runs beside this one (pdserve-base)")
    args = ap.parse_args()
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)  # 0: --profile alone
    args.duration, args.c1_duration = args.duration or (3 if args.quick else 8), args.c1_duration or (2 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    targets, kinds = [t for t in args.targets.split(",") if t], [k for k in args.kinds.split(",") if k]
    instances = [i for i in args.instances.split(",") if i]
    if args.base and "pdserve-base" not in targets:
        targets.append("pdserve-base")
    if (set(targets) - set(ALL_TARGETS) - {"pdserve-base"} or set(kinds) - {"c32", "c1", "stream"}
            or set(instances) - {"vllm", "pdserve"}):
        ap.error("unknown target, kind or instances")
    if args.protocol != "pull":
        targets = [t for t in targets if t not in ("vllm-router", "sglang-router")]  # they speak pull only
    cleanup = H.Cleanup()
    work = cleanup.work_dir("gateway")
    print(f"# gateway overhead (load {H.loadavg()}, {os.cpu_count()} cores, body {len(BODY)} B; rounds {args.rounds}, "
          f"c32 {args.duration} s, c1 {args.c1_duration} s, warm-up {args.warmup} s)", flush=True)
    try:
        results = {}
        for kind in instances:
            result = measure(kind, args, targets, kinds, cleanup, work)
            if result is None:
                return 1
            results[kind] = result
        print(f"\nload at the end: {H.loadavg()}")
        H.write_json(args.json, {"args": vars(args), "by_instances": results})
        return 0
    finally:
        cleanup.run()


if __name__ == "__main__":
    sys.exit(main())
