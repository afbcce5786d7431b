"""Routing policies side by side in front of the same pdserve instances: where the KV cache already is, and load.

Four instances of a 4-layer Llama (hidden 256), each with a KV cache far smaller than the workload's working set,
publishing KV events; in front of them, one router at a time: the pdserve gateway with `round_robin`,
`least_loaded`, `prefix_aware` (its old hash-sticky policy) and `kv_aware` (the KV-event prefix index), and
vllm-router's `cache_aware` (its approximate tree of the request text). Topologies: 4 colocated instances, and 2P2D
pull (P candidates scored; vllm-router in its PD mode with cache_aware for prefill, round_robin for decode).

Workloads (streamed chat requests, a closed loop of `--concurrency` clients or an open loop at `--rate`,
max_tokens 8):

* shared: G groups sharing a long system prompt, many users asking short questions (llm-d's B2B shape, scaled down);
* multiturn: conversations whose every turn extends the last (the Mooncake conversation trace's shape): a turn is
  sent only after the conversation's previous one was answered;
* unique: prompts that share nothing (kv_aware must cost nothing against least_loaded there).

Every (policy, round, workload) gets its own prompt text (a short salt in the first block), so no run finds
another's blocks.
Measured through public seams: the client's clock (TTFT to the first streamed token, wall time), the instances'
`vllm:prefix_cache_hits` deltas (hit tokens), the router's process CPU (/proc, schedstat). The bound for hit
tokens is computed offline from the same token ids: a router that knew every cache exactly, picking for each
request the instance with the longest cached prefix (ties to the least used), each cache an LRU of its blocks
(prompt and output), requests one after another in the order they were sent (`routing_reference.py`). It is
greedy, not an optimum: hash-sticky `prefix_aware` can exceed it.

    .venv/bin/python bench/routing.py --quick                                   # smoke run (~3 min)
    .venv/bin/python bench/routing.py --rounds 2 --json bench/out/routing.json   # the table in docs/benchmarks.md
    .venv/bin/python bench/routing.py --policies prefix_aware,kv_aware@1,kv_aware@4   # kv_aware@W: --kv-overlap-weight W
    .venv/bin/python bench/routing.py --base DIR --policies round_robin,kv_aware,base:round_robin,base:kv_aware
    .venv/bin/python bench/routing.py --topologies pull --conditional   # D alone where it holds the prompt

Targets (shared and multiturn): kv_aware p90 TTFT <= 0.5x round_robin and <= 0.8x vllm-router cache_aware,
throughput >= 1.2x round_robin; unique: kv_aware throughput >= 0.95x least_loaded; hit tokens >= 90 % of the
bound; the gateway's CPU per request with kv_aware <= 1.3x round_robin's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "tests")]
import harness as H  # noqa: E402
from proc_cpu import thread_seconds_by_name  # noqa: E402
from routing_fleet import MAX_MODEL_LEN, start_instances, start_router  # noqa: E402
from routing_reference import BS, explain_picks, offline_bound  # noqa: E402

PDSERVE_POLICIES = ("round_robin", "least_loaded", "prefix_aware", "kv_aware")
POLICIES = (*PDSERVE_POLICIES, "vllm-router:cache_aware")
WORKLOADS = ("shared", "multiturn", "unique")
MAX_TOKENS = 8
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
         "romeo sierra tango uniform victor whiskey xray yankee zulu amber basalt cedar dune ember fjord granite "
         "harbor island jasper kelp lagoon meadow nectar orchid prairie quartz reef summit tundra valley willow").split()


# ----------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Shape:
    """Workload sizes in words (this tokenizer makes about 2.9 tokens of one; the run prints the token counts)."""

    groups: int = 12  # shared: system prompts
    system_words: int = 140
    question_words: int = 12
    shared_requests: int = 96
    conversations: int = 12  # multiturn
    turns: int = 4
    first_words: int = 100
    answer_words: int = 10
    user_words: int = 20
    unique_requests: int = 64
    unique_words: int = 140


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build(workload: str, shape: Shape, seed: int = 7) -> list[list[list[dict]]]:
    """Conversations: each a list of turns (message lists); a turn goes out after the one before it."""
    rng = random.Random(seed)
    if workload == "shared":
        systems = [words(rng, shape.system_words) for _ in range(shape.groups)]
        return [[[{"role": "system", "content": systems[rng.randrange(shape.groups)]},
                  {"role": "user", "content": f"Question {n}: {words(rng, shape.question_words)}?"}]]
                for n in range(shape.shared_requests)]
    if workload == "multiturn":
        convs = []
        for c in range(shape.conversations):
            history = [{"role": "user", "content": f"Conversation {c}. {words(rng, shape.first_words)}"}]
            turns = []
            for t in range(shape.turns):
                turns.append(list(history))
                history += [{"role": "assistant", "content": words(rng, shape.answer_words)},
                            {"role": "user", "content": f"Turn {t + 1}: {words(rng, shape.user_words)}"}]
            convs.append(turns)
        return convs
    return [[[{"role": "user", "content": f"Unique {n}. {words(rng, shape.unique_words)}"}]]
            for n in range(shape.unique_requests)]


def salted(turn: list[dict], salt: str) -> list[dict]:
    return [{**turn[0], "content": f"[{salt}] {turn[0]['content']}"}, *turn[1:]]


def order(convs: list[list[list[dict]]], seed: int = 11) -> list[int]:
    ids = list(range(len(convs)))
    random.Random(seed).shuffle(ids)
    return ids


# ----------------------------------------------------------------------------- one run
def stream(http: Any, url: str, body: dict) -> tuple[float, int]:
    """(monotonic time of the first token, prompt tokens the serving instance found cached) of one streamed chat."""
    first, cached = None, -1
    for t, data in H.sse_data(http, url, body):
        chunk = json.loads(data)
        if "choices" not in chunk:
            raise RuntimeError(f"{url}: error in stream: {data[:500]}")
        if first is None and any((c.get("delta") or {}).get("content") or c.get("finish_reason")
                                 for c in chunk["choices"]):
            first = t
        usage = chunk.get("usage")
        if usage:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", -1)
    if first is None:
        raise RuntimeError(f"{url}: the stream had no token")
    return first, cached


def run(url: str, convs: list[list[list[dict]]], salt: str, concurrency: int, rate: float = 0.0,
        seed: int = 5) -> dict[str, Any]:
    """Send every turn (a conversation's turns in order): TTFTs, the prompt tokens each request found cached (the
    instances' own count, -1 where not said), wall time, and the order sent.

    `rate` 0: a closed loop of `concurrency` clients. `rate` > 0: an open loop, as llm-d and Dynamo measure: the
    conversations arrive as a Poisson process whose first turns come at `rate` times the share of first turns
    among all turns (so about `rate` requests a second reach the router while it keeps up), however many are still
    waiting for an answer; a conversation's next turn goes out when its previous one is answered."""
    lock = threading.Condition()
    ttfts: list[float] = []
    cached: list[int] = []
    sent_order: list[tuple[int, int]] = []
    errors: list[str] = []

    def send(http: Any, c: int, t: int) -> None:
        with lock:
            sent_order.append((c, t))
        body = {"model": "m", "messages": salted(convs[c][t], salt), "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        sent = time.monotonic()
        try:
            first, hit = stream(http, url + "/v1/chat/completions", body)
            with lock:
                ttfts.append(first - sent)
                cached.append(hit)
        except Exception as exc:  # noqa: BLE001 - counted and shown
            with lock:
                errors.append(str(exc)[:200])

    start = time.monotonic()
    if rate > 0:
        gen, at, arrivals = random.Random(seed), 0.0, {}
        conv_rate = rate * len(convs) / max(sum(map(len, convs)), 1)
        for c in order(convs):
            at += gen.expovariate(conv_rate)
            arrivals[c] = at

        def conversation(c: int) -> None:
            time.sleep(max(0.0, start + arrivals[c] - time.monotonic()))
            http = H.http_client(600)
            for t in range(len(convs[c])):
                send(http, c, t)

        threads = [threading.Thread(target=conversation, args=(c,), daemon=True) for c in arrivals]
    else:
        pending = [(c, 0) for c in order(convs)]
        in_flight = [0]

        def client() -> None:
            http = H.http_client(600)
            while True:
                with lock:
                    while not pending and in_flight[0]:
                        lock.wait()
                    if not pending:
                        return
                    c, t = pending.pop(0)
                    in_flight[0] += 1
                send(http, c, t)
                with lock:
                    in_flight[0] -= 1
                    if t + 1 < len(convs[c]):
                        pending.append((c, t + 1))
                    lock.notify_all()

        threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    # Daemon threads: on Ctrl-C or SIGTERM the interpreter would wait for every client to send all its requests
    # before the cleanup stops the instances.
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {"ttfts": ttfts, "cached": cached, "wall": time.monotonic() - start, "errors": errors,
            "order": sent_order}


def hit_tokens(client: Any, urls: list[str]) -> float:
    return sum(H.scrape(client, u).get("vllm:prefix_cache_hits_total", 0.0) for u in urls)


# ----------------------------------------------------------------------------- the whole run
def measure(args: argparse.Namespace, topology: str, model: Path, tokenizer: Any, cleanup: H.Cleanup,
            meter: H.CpuMeter) -> dict[str, Any]:
    servers = H.Servers(cleanup, meter)
    insts = start_instances(topology, model, args, servers)
    # What computes prompts (and so holds their blocks): every instance colocated, the prefill ones in pull (which
    # add one output token to their cache, not the answer); in pull with --conditional D too, which computes what
    # it serves alone, and the bound is then a router's that knew all four caches, each serving any request.
    every = topology == "colocated" or args.conditional
    holders = [i.url for n, i in insts.items() if every or not n.startswith("D")]
    output_tokens = MAX_TOKENS if every else 1
    client = H.http_client(60)
    workloads = [w for w in args.workloads.split(",") if topology == "colocated" or w != "unique"]
    results: dict[str, Any] = {}
    for w in workloads:
        convs = build(w, args.shape)
        tokens = [[tokenizer.encode_chat(salted(turn, "S000")) for turn in conv] for conv in convs]
        flat = [t for conv in tokens for t in conv]
        results[w] = {"tokens": tokens, "runs": {}, "prompt_tokens": sum(map(len, flat)), "requests": len(flat),
                      "mean_prompt_tokens": sum(map(len, flat)) / len(flat)}
        print(f"  {w}: {len(flat)} requests, prompts of {min(map(len, flat))}-{max(map(len, flat))} tokens "
              f"(mean {results[w]['mean_prompt_tokens']:.0f}), {sum(map(len, flat))} in all", flush=True)
    listed = args.policies.split(",")
    for rnd, policies in H.rotations(listed, args.rounds):
        for policy in policies:
            url, pid, stop, log_path = start_router(policy, topology, insts, model, servers, cleanup, args.explain,
                                                      args.base, args.conditional)
            for w in workloads:
                logged = log_path.stat().st_size if log_path else 0
                out = measure_one(url, pid, holders, client, build(w, args.shape), args,
                                  f"S{rnd}{listed.index(policy)}{WORKLOADS.index(w)}")
                if log_path:
                    with log_path.open(errors="replace") as log:
                        log.seek(logged)
                        out["explain"] = explain_picks(log.readlines())
                    print(f"  explain {w}: {out['explain']}; the instances hit {out['hits']:.0f}", flush=True)
                out["bound"] = offline_bound([results[w]["tokens"][c][t] for c, t in out.pop("order")], len(holders),
                                             args.blocks, output_tokens)
                results[w]["runs"].setdefault(policy, []).append(out)
                misses = sum(1 for hit in out["cached"] if 0 <= hit < results[w]["mean_prompt_tokens"] / 2)
                print(f"  {topology} round {rnd} {policy:24s} {w:9s} p50 {pct(out['ttfts'], 50) * 1e3:7.1f} p90 "
                      f"{pct(out['ttfts'], 90) * 1e3:7.1f} ms {len(out['ttfts']) / out['wall']:5.2f} req/s hits "
                      f"{out['hits']:7.0f} ({out['hits'] / max(out['bound'], 1):.2f} of {out['bound']}) "
                      f"mostly-missed {misses} cpu {out['cpu_us_per_req']:6.0f} us/req {out['threads_us_per_req']} "
                      f"errors {len(out['errors'])}", flush=True)
            stop()
    servers.stop()
    for data in results.values():
        del data["tokens"]
    return results


def measure_one(url: str, pid: int, holders: list[str], client: Any, convs: list, args: argparse.Namespace,
                salt: str) -> dict[str, Any]:
    """One workload through one router: the run, the holders' prefix-cache hits and the router's CPU."""
    # schedstat's nanoseconds, not /proc/<pid>/stat's 10 ms ticks (one tick is ~150 µs a request here); a router's
    # threads live as long as it does, so none that ends between the two readings is lost.
    before, threads0 = hit_tokens(client, holders), thread_seconds_by_name(pid)
    out = run(url, convs, salt, args.concurrency, args.rate)
    time.sleep(0.3)  # the last answers' blocks reach the metrics
    out["hits"] = hit_tokens(client, holders) - before
    answered = max(len(out["ttfts"]), 1)
    threads = thread_seconds_by_name(pid)
    out["cpu_us_per_req"] = (sum(threads.values()) - sum(threads0.values())) / answered * 1e6
    out["threads_us_per_req"] = {name: round((cpu - threads0.get(name, 0.0)) / answered * 1e6)
                                 for name, cpu in threads.items() if cpu > threads0.get(name, 0.0)}
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(results: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    table: dict[str, dict[str, dict[str, float]]] = {}
    for w, data in results.items():
        for policy, runs in data["runs"].items():
            ttfts = [t for r in runs for t in r["ttfts"]]
            table.setdefault(w, {})[policy] = {
                "p50_ms": pct(ttfts, 50) * 1e3, "p90_ms": pct(ttfts, 90) * 1e3,
                "req_s": H.median([len(r["ttfts"]) / r["wall"] for r in runs]),
                "hits": H.median([r["hits"] for r in runs]), "bound": H.median([r["bound"] for r in runs]),
                "hit_frac": H.median([r["hits"] / max(r["bound"], 1) for r in runs]),
                "cpu_us": H.median([r["cpu_us_per_req"] for r in runs]),
                "cpu_rounds": [r["cpu_us_per_req"] for r in runs],  # in round order: paired with the others'
                "errors": sum(len(r["errors"]) for r in runs)}
    return table


def checks(table: dict[str, dict[str, dict[str, float]]]) -> list[tuple[str, float, str, bool]]:
    out = []
    for w in ("shared", "multiturn"):
        row = table.get(w, {})
        kv, rr, ca = row.get("kv_aware"), row.get("round_robin"), row.get("vllm-router:cache_aware")
        if kv and rr:
            out.append((f"{w}: kv_aware / round_robin p90 TTFT", kv["p90_ms"] / rr["p90_ms"], "<= 0.5",
                        kv["p90_ms"] / rr["p90_ms"] <= 0.5))
            out.append((f"{w}: kv_aware / round_robin throughput", kv["req_s"] / rr["req_s"], ">= 1.2",
                        kv["req_s"] / rr["req_s"] >= 1.2))
        if kv and ca:
            out.append((f"{w}: kv_aware / cache_aware p90 TTFT", kv["p90_ms"] / ca["p90_ms"], "<= 0.8",
                        kv["p90_ms"] / ca["p90_ms"] <= 0.8))
    for w, row in table.items():
        kv = row.get("kv_aware")
        if kv and w != "unique":
            out.append((f"{w}: kv_aware hit tokens / offline bound", kv["hit_frac"], ">= 0.9", kv["hit_frac"] >= 0.9))
        for prefix in ("", "base:"):  # this checkout's gateway, and --base's beside it
            kv, rr = row.get(prefix + "kv_aware"), row.get(prefix + "round_robin")
            if kv and rr:
                out.append((f"{w}: {prefix}kv_aware / {prefix}round_robin gateway CPU per request",
                            kv["cpu_us"] / rr["cpu_us"], "<= 1.3", kv["cpu_us"] / rr["cpu_us"] <= 1.3))
                # The same, round by round (both ran in each round, minutes apart at most): on a box whose speed
                # drifts between rounds, the median of these ratios moves less than the ratio of two medians.
                paired = H.median([k / r for k, r in zip(kv["cpu_rounds"], rr["cpu_rounds"])])
                out.append((f"{w}: {prefix}kv_aware / {prefix}round_robin gateway CPU, median of the rounds' ratios",
                            paired, "<= 1.3", paired <= 1.3))
        for policy in [p for p in row if "base:" + p in row]:
            ratio = row[policy]["cpu_us"] / row["base:" + policy]["cpu_us"]
            out.append((f"{w}: {policy} gateway CPU per request, this checkout / --base", ratio, "< 1", ratio < 1))
    row = table.get("unique", {})
    if "kv_aware" in row and "least_loaded" in row:
        ratio = row["kv_aware"]["req_s"] / row["least_loaded"]["req_s"]
        out.append(("unique: kv_aware / least_loaded throughput", ratio, ">= 0.95", ratio >= 0.95))
    return out


def print_table(topology: str, table: dict[str, dict[str, dict[str, float]]]) -> None:
    print(f"\n{topology}")
    print("| workload | policy | TTFT p50 ms | TTFT p90 ms | req/s | hit tokens | bound | of bound | router CPU us/req |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for w, row in table.items():
        for policy, s in row.items():
            print(f"| {w} | {policy} | {s['p50_ms']:.0f} | {s['p90_ms']:.0f} | {s['req_s']:.2f} | {s['hits']:.0f} | "
                  f"{s['bound']:.0f} | {s['hit_frac']:.2f} | {s['cpu_us']:.0f} |"
                  + (f" errors {s['errors']}" if s["errors"] else ""))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a third of the requests, one round, colocated only")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--topologies", default="colocated,pull")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="any of " + ", ".join(POLICIES) + "; kv_aware@W runs kv_aware with --kv-overlap-weight W")
    p.add_argument("--blocks", type=int, default=96, help="KV blocks (of 16 tokens) per instance")
    p.add_argument("--concurrency", type=int, default=4, help="clients of the closed loop")
    p.add_argument("--rate", type=float, default=0.0, help="requests a second of an open loop (Poisson arrivals) "
                   "instead of the closed loop; at a rate near round_robin's capacity its queue grows and a "
                   "router that saves prefill keeps up (llm-d's and Dynamo's way of measuring)")
    p.add_argument("--conditional", action="store_true", help="pull: pdserve's gateways run --conditional (D alone "
                   "where it holds most of the prompt); hit tokens are then counted on all four instances")
    p.add_argument("--model-preset", default="h256", choices=["h256", "llama120m"],
                   help="llama120m (12 layers, hidden 768) makes a prompt's prefill most of its TTFT on a CPU box")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the instances' dtype")
    for name, value in vars(Shape()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    p.add_argument("--explain", action="store_true", help="kv_aware's gateway logs each pick (debug), and each run "
                   "tallies them against the instances' hits (its CPU figures are then not comparable)")
    p.add_argument("--base", default=None, help="a checkout (an older pdserve) whose gateway runs beside this "
                   "one's: `base:POLICY` in --policies runs POLICY there, in the same rounds")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.shape = Shape(**{name: getattr(args, name) for name in vars(Shape())})
    if args.quick:
        args.rounds, args.topologies = 1, "colocated"
        args.shape = replace(args.shape, shared_requests=args.shape.shared_requests // 3, turns=3,
                             unique_requests=args.shape.unique_requests // 3)
    from pdserve.tokenizer import Tokenizer
    from ttft import make_model

    cleanup, meter = H.Cleanup(), H.CpuMeter()
    model = make_model(cleanup.work_dir("routing"), MAX_MODEL_LEN, args.model_preset)
    tokenizer = Tokenizer(model)
    machine = {"cpu": H._cpu_info()[0], "cores": __import__("os").cpu_count(), "date": time.strftime("%Y-%m-%d")}
    print(f"{machine}; {args.blocks} blocks of {BS} per instance, concurrency {args.concurrency}, rate {args.rate}, "
          f"{args.shape}", flush=True)
    report: dict[str, Any] = {"machine": machine, "args": {k: v for k, v in vars(args).items() if k != "shape"}}
    for topology in args.topologies.split(","):
        try:
            results = measure(args, topology, model, tokenizer, cleanup, meter)
        except Exception as exc:  # noqa: BLE001 - the other topology's figures still count
            print(f"{topology}: FAILED: {exc!r}", flush=True)
            report[topology] = {"error": repr(exc)}
            continue
        table = summarize(results)
        print_table(topology, table)
        report[topology] = {"table": table, "workloads": {w: {k: v for k, v in r.items() if k != "runs"}
                                                          for w, r in results.items()},
                            "runs": {w: r["runs"] for w, r in results.items()}, "checks": checks(table)}
        for name, value, target, met in report[topology]["checks"]:
            print(f"  {name}: {value:.2f} (target {target}: {'met' if met else 'MISSED'})")
        H.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
