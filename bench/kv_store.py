"""The shared KV store tier: what it buys, what it costs, measured side by side in one run.

Two parts (`--part io|qa|all`):

* io: bytes per second of the two stores the tier runs on (Redis, Mooncake Store: a master and a segment-holding
  `mooncake_client`), through the tier's own backends, for batches of stored-block-sized values, put and get,
  beside a memcpy of the same bytes. This is the decision record's measurement.
* qa: multi-round QA in LMCache's shape over `--instances` pdserve instances (`--threads 1` each): `--users`
  users, each with a long context of its own, ask `--turns` questions; every turn's prompt is the whole
  conversation so far (the answers as generated) plus a new question, and lands on the next instance round-robin,
  so its history was usually computed elsewhere. Each instance's KV cache holds a fraction of the working set
  (printed). Modes, each on its own instances, in rounds of rotating order: no store, Redis, Mooncake. Reported:
  TTFT p50/p90 (client clock, streamed), throughput (output tokens per second of the whole run), and the prompt
  tokens computed against loaded from the store. Then, per store: one instance restarted mid-run (`--restarts`
  times), its first requests on known prefixes against a warm instance's at the same time, with both sides'
  server-side phases from the instances' timelines (lookup and queue wait, store load, arrival to first token);
  and `no-reuse` (every prompt new)
  throughput with each store against none, with where that run's CPU went: each process's CPU seconds (the
  instances, redis-server, Mooncake's master and `mooncake_client`) and the instances' by thread (the engine, the
  tier's writer; `kv_store_cpu.py`).

For figures to record, run it with nothing else on the box:

    .venv/bin/python bench/kv_store.py --part all --json bench/out/kv_store.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "tests")]
import harness as H  # noqa: E402
from kv_store_cpu import CpuSplit, find_py_spy, print_report  # noqa: E402
from store_servers import StoreServer  # noqa: E402
from ttft import make_model  # noqa: E402

STORES = ("redis", "mooncake")


def start_store(cleanup: H.Cleanup, kind: str, size: str) -> StoreServer:
    server = StoreServer(kind, cleanup.work_dir(f"store-{kind}"), size).start()
    cleanup.add(server.stop)
    return server


# ----------------------------------------------------------------------------- io: the stores' bytes per second


def io_part(cleanup: H.Cleanup, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pdserve.kv_store.backends import make_backend
    from pdserve.kv_store.config import store_config

    out: dict[str, Any] = {}
    for value_bytes in args.value_bytes:
        n = max(4, args.io_bytes // value_bytes)
        src = torch.randint(0, 255, (n, value_bytes), dtype=torch.uint8)
        dst = torch.empty_like(src)
        copy = H.timeit(lambda: dst.copy_(src), reps=5)
        row = {"memcpy": src.numel() / H.median(copy)}
        values = [bytes(src[i].numpy()) for i in range(n)]
        for kind in STORES:
            server = start_store(cleanup, kind, "2gb" if kind == "redis" else "2GB")
            backend = make_backend(store_config({"url": server.url, "local_buffer": "256MiB"}))
            backend.connect()
            keys = [f"io-{value_bytes}-{i}" for i in range(n)]
            puts, gets = [], []
            for rep in range(args.io_reps):
                items = [(f"{k}-{rep}", v) for k, v in zip(keys, values, strict=True)]
                t0 = time.perf_counter()
                assert all(backend.put(items, None))
                puts.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = backend.get([k for k, _ in items])
                gets.append(time.perf_counter() - t0)
                assert all(g is not None and len(g) == value_bytes for g in got)
            backend.close()
            server.stop()
            row[f"{kind} put"] = src.numel() / H.median(puts)
            row[f"{kind} get"] = src.numel() / H.median(gets)
        out[str(value_bytes)] = row
        print(f"values of {value_bytes} B, {n} per batch: " + ", ".join(
            f"{name} {v / 1e9:.2f} GB/s" for name, v in row.items()), flush=True)
    return out


# ----------------------------------------------------------------------------- qa: multi-round QA over instances


class Fleet:
    """One mode's instances: no store, or all sharing one store."""

    def __init__(self, servers: H.Servers, mode: str, model: Path, args: argparse.Namespace,
                 store: StoreServer | None) -> None:
        self.mode, self.servers, self.model, self.args = mode, servers, model, args
        self.config = json.dumps({"kv_store": {"url": store.url}}) if store is not None else None
        self.keys = [f"{mode}-{i}" for i in range(args.instances)]
        for key in self.keys:
            self.start(key)

    def start(self, key: str) -> None:
        a = self.args
        extra = ["--kv-transfer-config", self.config] if self.config else []
        self.servers.instance(key, self.model, "--threads", "1", "--num-kv-blocks", str(a.kv_blocks),
                              "--max-model-len", str(a.max_model_len), "--served-model-name", "tiny",
                              "--dtype", a.dtype, "--disable-log-requests", *extra)

    def restart(self, index: int) -> None:
        key = self.keys[index]
        self.servers.procs.pop(key).stop()
        self.start(key)

    def url(self, index: int) -> str:
        return self.servers.url(self.keys[index % len(self.keys)])


def ask(client: Any, url: str, prompt: list[int], max_tokens: int, request_id: str) -> tuple[float, list[int]]:
    """(TTFT in seconds, the answer's token ids) of one streamed greedy completion."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    t0 = time.monotonic()
    first, tokens = None, []
    for t, data in H.sse_data(client, f"{url}/v1/completions", body, {"X-Request-Id": request_id}):
        chunk = json.loads(data)
        for choice in chunk.get("choices", [])[:1]:
            tokens += choice.get("token_ids") or []
            if first is None and choice.get("token_ids"):
                first = t
    if first is None:
        raise RuntimeError(f"{url}: no token")
    return first - t0, tokens


class Conversation:
    def __init__(self, gen: random.Random, context: int, question: int) -> None:
        self.gen, self.question, self.turn = gen, question, 0
        self.history = self.tokens(context)

    def tokens(self, n: int) -> list[int]:
        return [self.gen.randrange(100, 32000) for _ in range(n)]

    def next_prompt(self) -> list[int]:
        return self.history + self.tokens(self.question)


def turns(fleet: Fleet, users: list[Conversation], args: argparse.Namespace, count: int,
          route: Any = None, reuse: bool = True) -> dict[str, Any]:
    """`count` more turns of every user (each user's in order, `--concurrency` users at a time): turn t of user u
    goes to instance `route(u, t)` (round-robin by default). TTFTs (by instance) and output tokens per second."""
    route = route or (lambda u, t: u + t)
    ttfts: dict[int, list[float]] = {}
    by_turn: dict[int, list[float]] = {}
    rids: dict[int, list[str]] = {}
    out_tokens = [0]
    lock = threading.Lock()

    def user(u: int) -> None:
        conv = users[u]
        with H.http_client(300) as client:
            for _ in range(count):
                prompt = conv.next_prompt() if reuse else conv.tokens(len(conv.next_prompt()))
                index = route(u, conv.turn) % len(fleet.keys)
                rid = f"kvs-{uuid.uuid4().hex[:16]}"
                ttft, answer = ask(client, fleet.url(index), prompt, args.answer, rid)
                with lock:
                    by_turn.setdefault(conv.turn, []).append(ttft)
                    ttfts.setdefault(index, []).append(ttft)
                    rids.setdefault(index, []).append(rid)
                    out_tokens[0] += len(answer)
                conv.history, conv.turn = prompt + answer, conv.turn + 1

    t0 = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(user, range(len(users))))
    wall = time.monotonic() - t0
    return {"ttft": [t for ts in ttfts.values() for t in ts], "by_instance": ttfts, "rids": rids, "wall": wall,
            "tok_s": out_tokens[0] / wall, "first_turn": by_turn.get(0, []),
            "later_turns": [t for turn, ts in by_turn.items() if turn > 0 for t in ts]}


def conversations(args: argparse.Namespace, seed: int) -> list[Conversation]:
    gen = random.Random(seed)
    return [Conversation(random.Random(gen.random()), args.context, args.question) for _ in range(args.users)]


def counters(client: Any, fleet: Fleet) -> dict[str, float]:
    total: dict[str, float] = {}
    for i in range(len(fleet.keys)):
        for name, value in H.scrape(client, fleet.url(i)).items():
            total[name] = total.get(name, 0.0) + value
    return total


def drained(client: Any, fleet: Fleet, max_wait_s: float = 30.0) -> None:
    """Until the instances' write queues are empty: the CPU of a run's last writes is the run's."""
    deadline = time.monotonic() + max_wait_s
    while counters(client, fleet).get("pdserve:kv_store_write_queue_bytes", 0.0) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def qa_rounds(fleets: dict[str, Fleet], args: argparse.Namespace, reuse: bool,
              cpu: dict[str, CpuSplit] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every mode on the same workload each round (a new one each round), in rotating order; each mode's turns
    measured by `cpu[mode]` where given."""
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in fleets}
    with H.http_client(60) as client:
        for rnd, order in H.rotations(list(fleets), args.rounds):
            for mode in order:
                before = counters(client, fleets[mode])
                if cpu:
                    cpu[mode].mark()
                r = turns(fleets[mode], conversations(args, 1000 * rnd + reuse), args, args.turns, reuse=reuse)
                if cpu:
                    drained(client, fleets[mode])
                    cpu[mode].add()
                after = counters(client, fleets[mode])
                r["computed"] = H.delta(after, before, "pdserve:prompt_tokens_computed_total")
                r["loaded"] = H.delta(after, before, "pdserve:kv_store_hit_blocks_total") * 16
                r["written"] = H.delta(after, before, "pdserve:kv_store_blocks_written_total")
                r["dropped"] = H.delta(after, before, "pdserve:kv_store_writes_dropped_total")
                r.pop("by_instance")
                r.pop("rids")
                results[mode].append(r)
                print(f"  round {rnd} {mode:9s} TTFT p50 {p(r['ttft'], 50) * 1e3:7.1f} ms p90 "
                      f"{p(r['ttft'], 90) * 1e3:7.1f} ms, {r['tok_s']:6.1f} tok/s, prompt tokens computed "
                      f"{r['computed']:.0f}, loaded {r['loaded']:.0f}; blocks written {r['written']:.0f}, dropped "
                      f"{r['dropped']:.0f}", flush=True)
    return results


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    out = {}
    for mode, runs in results.items():
        ttft = [t for r in runs for t in r["ttft"]]
        # A conversation's first turn has nothing to reuse; the later turns are what a store can shorten.
        first, later = ([t for r in runs for t in r[part]] for part in ("first_turn", "later_turns"))
        out[mode] = {"ttft_p50_ms": p(ttft, 50) * 1e3, "ttft_p90_ms": p(ttft, 90) * 1e3,
                     "first_turn_p90_ms": p(first, 90) * 1e3 if first else 0.0,
                     "later_turns_p50_ms": p(later, 50) * 1e3 if later else 0.0,
                     "later_turns_p90_ms": p(later, 90) * 1e3 if later else 0.0,
                     "tok_s": H.median([r["tok_s"] for r in runs]), "computed": sum(r["computed"] for r in runs),
                     "loaded": sum(r["loaded"] for r in runs), "written": sum(r["written"] for r in runs),
                     "dropped": sum(r["dropped"] for r in runs)}
    base = out.get("none")
    for mode, row in out.items():
        if base is not None and mode != "none":
            row["ttft_p90_ratio"] = row["ttft_p90_ms"] / base["ttft_p90_ms"]
            row["ttft_p50_ratio"] = row["ttft_p50_ms"] / base["ttft_p50_ms"]
            row["tok_s_ratio"] = row["tok_s"] / base["tok_s"]
            if base["later_turns_p90_ms"]:
                row["later_turns_p90_ratio"] = row["later_turns_p90_ms"] / base["later_turns_p90_ms"]
        print(f"{mode:9s} TTFT p50 {row['ttft_p50_ms']:7.1f} ms p90 {row['ttft_p90_ms']:7.1f} ms, "
              f"{row['tok_s']:6.1f} tok/s" + (f"  vs none: p90 {row['ttft_p90_ratio']:.2f}x, p50 "
                                              f"{row['ttft_p50_ratio']:.2f}x, throughput {row['tok_s_ratio']:.2f}x"
                                              if "tok_s_ratio" in row else ""), flush=True)
        print(f"{'':9s} first turns p90 {row['first_turn_p90_ms']:7.1f} ms; later turns p50 "
              f"{row['later_turns_p50_ms']:7.1f} ms p90 {row['later_turns_p90_ms']:7.1f} ms"
              + (f"  (vs none {row['later_turns_p90_ratio']:.2f}x)" if "later_turns_p90_ratio" in row else ""),
              flush=True)
    return out


def restart_part(fleets: dict[str, Fleet], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Half the users' conversations, instance 0 restarted, then every user's next turn: half on the restarted
    instance, half on warm instance 1, interleaved. Their TTFT medians, restarted over warm."""
    out = {}
    for mode, fleet in fleets.items():
        restarted: list[float] = []
        warmed: list[float] = []
        spans: dict[str, list[dict[str, float]]] = {"restarted": [], "warm": []}
        for k in range(args.restarts):  # each on new conversations; the medians pool every restart's requests
            users = conversations(args, 777 + k)
            turns(fleet, users, args, args.turns - 1)
            fleet.restart(0)
            r = turns(fleet, users, args, 1, route=lambda u, t: 0 if u % 2 == 0 else 1)
            restarted += r["by_instance"][0]
            warmed += r["by_instance"][1]
            with H.http_client(30) as client:
                for side, index in (("restarted", 0), ("warm", 1)):
                    spans[side] += [phases(client, fleet.url(index), rid) for rid in r["rids"][index]]
        cold, warm = H.median(restarted), H.median(warmed)
        out[mode] = {"restarted_ms": cold * 1e3, "warm_ms": warm * 1e3, "ratio": cold / warm,
                     "samples": len(restarted)}
        print(f"restart {mode:9s} first requests on known prefixes: restarted {cold * 1e3:7.1f} ms, warm "
              f"{warm * 1e3:7.1f} ms: {cold / warm:.2f}x ({len(restarted)} requests a side)", flush=True)
        for side, rows in spans.items():
            medians = {k: H.median([row[k] for row in rows if math.isfinite(row[k])]) * 1e3 for k in PHASES}
            out[mode][f"{side}_phases_ms"] = medians
            print(f"    {side:9s} server side, medians: " + ", ".join(f"{k} {v:.1f} ms" for k, v in medians.items()),
                  flush=True)
    return out


# A request's server-side phases from its timeline: arrival to its KV load or step (the store lookup and the queue),
# the load, and arrival to the first token.
PHASES = ("wait", "load", "first token")


def phases(client: Any, url: str, request_id: str) -> dict[str, float]:
    ev = H.timeline_events(client, url, request_id)
    queued, first = H.first_event(ev, "queued"), H.first_event(ev, "first_token")
    start, end = H.first_event(ev, "kv_transfer_start"), H.first_event(ev, "kv_transfer_end")
    loaded = math.isfinite(start) and math.isfinite(end)  # no such events: the request loaded nothing
    began = start if loaded else H.first_event(ev, "scheduled")
    return {"wait": began - queued, "load": end - start if loaded else 0.0, "first token": first - queued}


def qa_part(cleanup: H.Cleanup, args: argparse.Namespace) -> dict[str, Any]:
    work = cleanup.work_dir("kv-store")
    model = make_model(work, args.max_model_len)
    meter = H.CpuMeter()
    servers = H.Servers(cleanup, meter)
    stores = {kind: start_store(cleanup, kind, "1gb" if kind == "redis" else "1GB") for kind in STORES}
    fleets = {"none": Fleet(servers, "none", model, args, None)}
    fleets.update({kind: Fleet(servers, kind, model, args, stores[kind]) for kind in STORES})
    per_user = args.context + args.turns * (args.question + args.answer)
    print(f"working set {args.users * per_user} tokens ({args.users} users x {per_user}), one instance's KV cache "
          f"{args.kv_blocks * 16} tokens: {args.users * per_user / (args.kv_blocks * 16):.1f}x", flush=True)
    turns(fleets["none"], conversations(args, 5), args, 1)  # warm-up (kernels, pages), not measured
    reuse = summarize(qa_rounds(fleets, args, reuse=True))
    restart = restart_part(fleets, args)
    print("no reuse (every prompt new):")
    splits = {mode: CpuSplit([fleet.servers.procs[key].pid for key in fleet.keys],
                             store_processes(stores[mode]) if mode in stores else {})
              for mode, fleet in fleets.items()}
    no_reuse = summarize(qa_rounds(fleets, args, reuse=False, cpu=splits))
    py_spy = find_py_spy(args.py_spy)
    cpu = {mode: split.report(py_spy) for mode, split in splits.items()}
    print("where the no-reuse run's CPU went" + ("" if py_spy else " (no py-spy: threads not split)") + ":")
    for mode, r in cpu.items():
        print_report(mode, r)
        no_reuse[mode]["cpu"] = r
    return {"reuse": reuse, "restart": restart, "no_reuse": no_reuse}


def store_processes(server: StoreServer) -> dict[str, list[int]]:
    names = ("redis-server",) if server.kind == "redis" else ("mooncake_master", "mooncake_client")
    return {name: [proc.pid] for name, proc in zip(names, server.procs, strict=True)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["io", "qa", "all"], default="all")
    ap.add_argument("--value-bytes", type=int, nargs="+", default=[64 << 10, 1 << 20], help="io: one value's size")
    ap.add_argument("--io-bytes", type=int, default=64 << 20, help="io: bytes per batch")
    ap.add_argument("--io-reps", type=int, default=5)
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024, help="tokens of each user's own context")
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=6, help="users asking at once")
    ap.add_argument("--kv-blocks", type=int, default=400, help="each instance's KV cache, in blocks of 16 tokens")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the instances' weights and KV cache (bfloat16 halves the bytes a block puts in the store)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--restarts", type=int, default=1, help="restarts of instance 0 per mode (samples pooled)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--py-spy", default=None, help="py-spy to name the instances' threads with (default: the "
                    "venv's, or PATH's)")
    args = ap.parse_args()
    cleanup = H.Cleanup()
    print(f"box: {H._cpu_info()[0]}, {os.cpu_count()} cores, load {H.loadavg()}, {time.strftime('%Y-%m-%d')}",
          flush=True)
    results: dict[str, Any] = {"args": vars(args)}
    if args.part in ("io", "all"):
        results["io"] = io_part(cleanup, args)
    if args.part in ("qa", "all"):
        results["qa"] = qa_part(cleanup, args)
    H.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
