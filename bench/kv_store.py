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
  tokens computed against loaded from the store. Then, per store: one instance restarted mid-run, its first
  requests on known prefixes against a warm instance's at the same time; and `no-reuse` (every prompt new)
  throughput with each store against none.

Run under `/work/tools/boxlock bench` for figures to record:

    .venv/bin/python bench/kv_store.py --part all --json bench/out/kv_store.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "tests")]
import harness as H  # noqa: E402
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
                              "--disable-log-requests", *extra)

    def restart(self, index: int) -> None:
        key = self.keys[index]
        self.servers.procs.pop(key).stop()
        self.start(key)

    def url(self, index: int) -> str:
        return self.servers.url(self.keys[index % len(self.keys)])


def ask(client: Any, url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(TTFT in seconds, the answer's token ids) of one streamed greedy completion."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    t0 = time.monotonic()
    first, tokens = None, []
    for t, data in H.sse_data(client, f"{url}/v1/completions", body):
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
        self.gen, self.question = gen, question
        self.history = self.tokens(context)

    def tokens(self, n: int) -> list[int]:
        return [self.gen.randrange(100, 32000) for _ in range(n)]

    def next_prompt(self) -> list[int]:
        return self.history + self.tokens(self.question)


def qa_run(fleet: Fleet, args: argparse.Namespace, seed: int, reuse: bool = True) -> dict[str, Any]:
    """Every user's turns (each user's in order, `--concurrency` users at a time); TTFTs and throughput."""
    gen = random.Random(seed)
    users = [Conversation(random.Random(gen.random()), args.context, args.question) for _ in range(args.users)]
    ttfts: list[float] = []
    out_tokens = [0]
    lock = threading.Lock()

    def user(u: int) -> None:
        conv = users[u]
        with H.http_client(300) as client:
            for turn in range(args.turns):
                prompt = conv.next_prompt() if reuse else conv.tokens(len(conv.next_prompt()))
                ttft, answer = ask(client, fleet.url(u + turn), prompt, args.answer)
                conv.history = prompt + answer
                with lock:
                    ttfts.append(ttft)
                    out_tokens[0] += len(answer)

    t0 = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(user, range(args.users)))
    wall = time.monotonic() - t0
    return {"ttft": ttfts, "wall": wall, "tok_s": out_tokens[0] / wall}


def counters(client: Any, fleet: Fleet) -> dict[str, float]:
    total: dict[str, float] = {}
    for i in range(len(fleet.keys)):
        for name, value in H.scrape(client, fleet.url(i)).items():
            total[name] = total.get(name, 0.0) + value
    return total


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]
