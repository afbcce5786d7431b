"""The pdserve gateway vs vllm-router in front of the SAME live vLLM-CPU NIXL prefill/decode pair, in one run.

A vLLM NixlConnector producer and consumer (host-memory KV) serve the tiny Qwen3 model; both routers drive them
with the NIXL P/D protocol (P prefills and holds, D reads P's blocks). Interleaved in rounds whose order rotates:

* c1:  streamed completions one at a time; TTFT = first token chunk as the client sees it (p50 over requests).
       Each prompt starts with a fresh number so no request hits vLLM's prefix cache.
* c16: 16 client threads, non-streaming; the router's CPU per request = utime+stime of its process tree
       (/proc/<pid>/stat) over the run divided by the requests answered.

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

    def cpu_per_request_us(self, url: str, pid: int, n: int, conns: int) -> tuple[float, float]:
        """(router CPU us per request, requests per second) for n non-streaming requests over `conns` threads."""
        bodies = [self.body(False) for _ in range(n)]
        tree = H.descendants(pid)

        def one(body: dict[str, Any]) -> None:
            with H.http_client(120) as client:
                r = client.post(url + "/v1/completions", json=body)
                if r.status_code != 200 or not r.json()["choices"][0]["text"]:
                    raise RuntimeError(f"{url}: {r.status_code} {r.text[:300]}")

        cpu0, t0 = sum(H.cpu_seconds(p) for p in tree), time.monotonic()
        with ThreadPoolExecutor(conns) as pool:
            list(pool.map(one, bodies))
        wall = time.monotonic() - t0
        return (sum(H.cpu_seconds(p) for p in tree) - cpu0) / n * 1e6, n / wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--c1-requests", type=int, default=10, help="streamed requests per target and round at c=1")
    ap.add_argument("--c16-requests", type=int, default=64, help="requests per target and round at c=16")
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=40, help="~4 tokens each")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from pdserve.modelgen import make_text_model

    cleanup = H.Cleanup()
    work = cleanup.work_dir("vllm-fleet")
    model = make_text_model("qwen3", work / "qwen3")
    prefill, decode = start_pd(model)
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
            for target in order:
                url, pid = routers[target]
                ttft = load.ttft_ms(client, url, args.c1_requests)
                cpu_us, rps = load.cpu_per_request_us(url, pid, args.c16_requests, args.conns)
                runs.append({"round": rnd, "target": target, "ttft_p50_ms": H.median(ttft), "ttft_all_ms": ttft,
                             "cpu_us_per_req": cpu_us, "rps_c16": rps, "load": H.loadavg()})
                print(f"round {rnd} {target:12s} TTFT p50 {H.median(ttft):7.1f} ms   CPU {cpu_us:7.0f} us/req   "
                      f"{rps:5.1f} req/s at c={args.conns}   load {H.loadavg()}", flush=True)
    summary = summarize(runs)
    H.write_json(args.json, {"args": vars(args), "runs": runs, "summary": summary})
    return 0 if all(summary["checks"].values()) else 1


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rows = {t: {k: H.median([r[k] for r in runs if r["target"] == t]) for k in ("ttft_p50_ms", "cpu_us_per_req",
                                                                                "rps_c16")} for t in TARGETS}
    pd, vr = rows["pdserve"], rows["vllm-router"]
    checks = {"ttft": pd["ttft_p50_ms"] <= vr["ttft_p50_ms"],
              "cpu": pd["cpu_us_per_req"] <= TARGET_CPU_RATIO * vr["cpu_us_per_req"]}
    print("\n| router | TTFT p50 at c=1 (ms) | router CPU per request at c=16 (us) | req/s at c=16 |")
    print("|---|---|---|---|")
    for t in TARGETS:
        print(f"| {t} | {rows[t]['ttft_p50_ms']:.1f} | {rows[t]['cpu_us_per_req']:.0f} | {rows[t]['rps_c16']:.1f} |")
    print(f"\npdserve / vllm-router: TTFT {pd['ttft_p50_ms'] / vr['ttft_p50_ms']:.2f} (target <= 1: "
          f"{'met' if checks['ttft'] else 'MISSED'}), CPU per request {pd['cpu_us_per_req'] / vr['cpu_us_per_req']:.2f} "
          f"(target <= {TARGET_CPU_RATIO}: {'met' if checks['cpu'] else 'MISSED'})")
    return {"rows": rows, "checks": checks}


if __name__ == "__main__":
    sys.exit(main())
