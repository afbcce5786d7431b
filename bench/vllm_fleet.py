"""The pdserve gateway vs vllm-router in front of the SAME live vLLM-CPU NIXL prefill/decode pair, in one run.

A vLLM NixlConnector producer and consumer (host-memory KV) serve the tiny Qwen3 model; both routers drive them
with the NIXL P/D protocol (P prefills and holds, D reads P's blocks). Interleaved in rounds whose order rotates:

* c1:  streamed completions one at a time; TTFT = first token chunk as the client sees it (p50 over requests).
       Each prompt starts with a fresh number so no request hits vLLM's prefix cache.
* c16: 16 client threads, non-streaming; the router's CPU per request = its process tree's CPU time over the run
       (/proc/<pid>/task/*/schedstat: ns resolution; /proc/<pid>/stat's utime+stime counts 10 ms ticks, too coarse
       for the few requests vLLM-CPU answers per second) divided by the requests answered.
* idle: each router's CPU over an idle window. The pdserve gateway probes /health (and /version, to know what
       each instance is) every second, and scrapes /metrics only where load decides between instances; at the 1-3
       requests per second vLLM-CPU serves here, that background work is a large share of its CPU per request, so
       "net" subtracts the idle rate.

Both vLLM processes busy-poll a core each (NIXL's UCX progress thread), so on a small box every figure is
noisy: compare the two routers round by round, not against other tables.

    .venv/bin/python bench/vllm_fleet.py --rounds 3 --json bench/out/vllm_fleet.json

The vLLM venv comes from scripts/install_vllm.sh (.cache/vllm; PDSERVE_VLLM_VENV points at another one),
vllm-router from .cache/peers/vllm-router (as bench/gateway.py installs it).
Targets: pdserve TTFT p50 at c=1 <= vllm-router's; pdserve CPU per request at c=16 <= 1.5x vllm-router's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "tests")]
import gateway as G
import harness as H
from peers import wait_healthy
from vllm_live import SERVED_NAME, start_pd

TARGETS = ("pdserve", "vllm-router")
TARGET_CPU_RATIO = 1.5


def start_routers(p_url: str, d_url: str, cleanup: H.Cleanup) -> dict[str, Any]:
    from pdserve.launcher import start

    pdserve = start("gateway", ["gateway", "--prefill", p_url, "--decode", d_url, "--protocol", "pull",
                                "--policy", "round_robin", "--port", "0", "--log-level", "warning"])
    cleanup.add(pdserve.stop)
    port = H.free_port()
    router = subprocess.Popen(
        [G.peer_exe("vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
         "--prefill", p_url, "--decode", d_url, "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(H.free_port()), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    cleanup.add(lambda: G.Proc("vllm-router", router, "", Path(tempfile.gettempdir())).stop())
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, router)
    return {"pdserve": (pdserve.url, pdserve.pid), "vllm-router": (url, router.pid)}


class Load:
    def __init__(self, prompt_words: int, max_tokens: int) -> None:
        self.prompt_words, self.max_tokens, self.counter = prompt_words, max_tokens, 0

    def body(self, stream: bool) -> dict[str, Any]:
        self.counter += 1  # a new first token: no prefix-cache hit on P
        return {"model": SERVED_NAME, "prompt": f"{self.counter} " + "tokens of a prompt " * self.prompt_words,
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}

    def ttft_ms(self, client: Any, url: str, n: int) -> list[float]:
        out = []
        for _ in range(n):
            sent = time.monotonic()
            first, text = H.stream_first(client, url + "/v1/completions", self.body(True))
            if not text:
                raise RuntimeError(f"{url}: empty answer")
            out.append((first - sent) * 1e3)
        return out

    def cpu_per_request_us(self, url: str, pid: int, n: int, conns: int) -> tuple[float, float, float]:
        """(router CPU us per request, wall seconds, requests per second) for n non-streaming requests."""
        bodies = [self.body(False) for _ in range(n)]
        tree = H.descendants(pid)

        def one(body: dict[str, Any]) -> None:
            with H.http_client(120) as client:
                r = client.post(url + "/v1/completions", json=body)
                if r.status_code != 200 or not r.json()["choices"][0]["text"]:
                    raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")

        cpu0, t0 = tree_cpu(tree), time.monotonic()
        with ThreadPoolExecutor(conns) as pool:
            list(pool.map(one, bodies))
        wall = time.monotonic() - t0
        return (tree_cpu(tree) - cpu0) / n * 1e6, wall, n / wall


def tree_cpu(tree: list[int]) -> float:
    return sum(G.sched_seconds(p) for p in tree)


def idle_cores(routers: dict[str, Any], seconds: float) -> dict[str, float]:
    """Each router's CPU (in cores) over an idle window: its background work."""
    trees = {t: H.descendants(pid) for t, (_, pid) in routers.items()}
    before, t0 = {t: tree_cpu(tree) for t, tree in trees.items()}, time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return {t: (tree_cpu(tree) - before[t]) / wall for t, tree in trees.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--c1-requests", type=int, default=10, help="streamed requests per target and round at c=1")
    ap.add_argument("--c16-requests", type=int, default=64, help="requests per target and round at c=16")
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=40, help="~4 tokens each")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--idle-s", type=float, default=10.0, help="idle window per round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from pdserve.modelgen import make_text_model

    cleanup = H.Cleanup()
    work = cleanup.work_dir("vllm-fleet")
    model = make_text_model("qwen3", work / "qwen3")
    prefill, decode = start_pd(model, quiet_nixl=False)
    cleanup.add(prefill.stop)
    cleanup.add(decode.stop)
    routers = start_routers(prefill.url, decode.url, cleanup)
    load = Load(args.prompt_words, args.max_tokens)
    print(f"# load {H.loadavg()}; vLLM P {prefill.url} D {decode.url}", flush=True)
    runs: list[dict[str, Any]] = []
    with H.http_client(120) as client:
        for url, _ in routers.values():  # warm-up: NIXL handshake, first-request costs
            load.ttft_ms(client, url, 2)
        for rnd, order in H.rotations(TARGETS, args.rounds):
            idle = idle_cores(routers, args.idle_s)
            for target in order:
                url, pid = routers[target]
                ttft = load.ttft_ms(client, url, args.c1_requests)
                cpu_us, wall, rps = load.cpu_per_request_us(url, pid, args.c16_requests, args.conns)
                net_us = cpu_us - idle[target] * wall / args.c16_requests * 1e6
                runs.append({"round": rnd, "target": target, "ttft_p50_ms": H.median(ttft), "ttft_all_ms": ttft,
                             "cpu_us_per_req": cpu_us, "net_us_per_req": net_us, "rps_c16": rps,
                             "idle_core_pct": idle[target] * 100, "load": H.loadavg()})
                print(f"round {rnd} {target:12s} TTFT p50 {H.median(ttft):7.1f} ms   CPU {cpu_us:7.0f} us/req "
                      f"(net of idle {net_us:6.0f})   {rps:5.1f} req/s at c={args.conns}   idle "
                      f"{idle[target] * 100:.2f} % of a core   load {H.loadavg()}", flush=True)
    summary = summarize(runs)
    H.write_json(args.json, {"args": vars(args), "runs": runs, "summary": summary})
    return 0 if all(summary["checks"].values()) else 1


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("ttft_p50_ms", "cpu_us_per_req", "net_us_per_req", "rps_c16", "idle_core_pct")
    rows = {t: {k: H.median([r[k] for r in runs if r["target"] == t]) for k in keys} for t in TARGETS}
    pd, vr = rows["pdserve"], rows["vllm-router"]
    ratios = {"ttft": pd["ttft_p50_ms"] / vr["ttft_p50_ms"], "cpu": pd["cpu_us_per_req"] / vr["cpu_us_per_req"],
              "cpu_net": pd["net_us_per_req"] / vr["net_us_per_req"]}
    checks = {"ttft": ratios["ttft"] <= 1, "cpu": ratios["cpu"] <= TARGET_CPU_RATIO}
    print("\n| router | TTFT p50 at c=1 (ms) | router CPU us/request at c=16 | net of idle | req/s at c=16 | "
          "idle CPU (% of a core) |")
    print("|---|---|---|---|---|---|")
    for t in TARGETS:
        r = rows[t]
        print(f"| {t} | {r['ttft_p50_ms']:.1f} | {r['cpu_us_per_req']:.0f} | {r['net_us_per_req']:.0f} | "
              f"{r['rps_c16']:.1f} | {r['idle_core_pct']:.2f} |")
    print(f"\npdserve / vllm-router: TTFT {ratios['ttft']:.2f} (target <= 1: {'met' if checks['ttft'] else 'MISSED'}), "
          f"CPU per request {ratios['cpu']:.2f} (target <= {TARGET_CPU_RATIO}: {'met' if checks['cpu'] else 'MISSED'}), "
          f"net of idle {ratios['cpu_net']:.2f}")
    return {"rows": rows, "ratios": ratios, "checks": checks}


if __name__ == "__main__":
    sys.exit(main())
