"""TTFT of E->P->D against colocated for 1 and 4 images, and the time an encoder-cache hit saves, in one run.

Model: the tiny LLaVA of pdserve.modelgen.llava (CLIP tower 64 wide, 2 layers, 16 image tokens per image; Llama text
model 128 wide, 2 layers). Images: seeded random RGB pixels as PNG data URLs (--image-size, default 336x336, resized
to 32x32 by the processor). Chat requests [text, image x k, text], max_tokens 8, greedy, streamed with `logprobs`
(every token its own chunk); TTFT = send -> first streamed token chunk (the role chunk is skipped).

Processes, all real: per EC connector (ECStorageConnector: E writes safetensors to a shared folder; ECP2PConnector:
P fetches E's in-memory outputs over ZMQ) an encode instance E, P (kv_producer + ec_consumer), D (kv_consumer +
ec_consumer) and a gateway `--encode E --prefill P --decode D`; shared by all sets: C (colocated), C_nopc (without
prefix caching) and a `--protocol colocated` gateway in front of C (C_gw: as many HTTP hops as E->P->D has).
Modes per image count (each "new" mode gets never-seen images; each "hit" mode repeats its "new" mode's images in
the same rep, after all new modes ran; orders shuffled each rep): C_new, C_gw_new, C_nopc_new, epd_new; C_hit and
C_nopc_hit (same images, other text after them: encoder-cache hit, plus KV prefix hits on C); epd_hit (gateway
cache hit: E not called; P's encoder and prefix caches); epd_hit_pre (other text BEFORE the images: no KV prefix can
match, encoder-side reuse only). Checks and breakdown per request from /metrics deltas (the gateway's encode items
and legs, E's encoder runs, P's / C's encoder-cache hits, EC loads, prefix hits, each instance's own TTFT) and E's
request timeline (encode_start -> encode_end).

  .venv/bin/python bench/epd.py --quick                                 # smoke run (~1 min)
  .venv/bin/python bench/epd.py --json bench/out/epd.json               # the table in docs/benchmarks.md
  .venv/bin/python bench/epd.py --connectors ECP2PConnector --image-size 64
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

MODEL_NAME = "llava"
CONNECTORS = ("ECStorageConnector", "ECP2PConnector")
NEW_MODES = ("C_new", "C_gw_new", "C_nopc_new", "epd_new")
HIT_MODES = ("C_hit", "C_nopc_hit", "epd_hit", "epd_hit_pre")
HIT_OF = {"C_hit": "C_new", "C_nopc_hit": "C_nopc_new", "epd_hit": "epd_new", "epd_hit_pre": "epd_new"}
WORDS = ("red", "blue", "cat", "dog", "tree", "house", "car", "sky", "river", "stone", "bird", "road", "light",
         "small", "large", "old", "new", "quick", "slow", "green")


def png_data_url(seed: int, size: int) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, cleanup: H.Cleanup, meter: H.CpuMeter) -> None:
        self.args, self.work, self.contention = args, work, meter
        self.servers = H.Servers(cleanup, meter)  # C, C_nopc and G_C for the whole run
        self.set_servers = H.Servers(cleanup, meter)  # E, P, D and G for one connector
        self.seed = 1000
        self.gen = random.Random(99)

    def url(self, key: str) -> str:
        return (self.servers.procs.get(key) or self.set_servers.procs[key]).url

    def common(self) -> list[str]:
        a = self.args
        return ["--max-model-len", str(a.max_model_len), "--num-kv-blocks", str(a.kv_blocks), "--threads",
                str(a.threads), "--served-model-name", MODEL_NAME, "--log-level", "warning"]

    def start_shared(self, model: Path) -> None:
        sv = self.servers
        sv.instance("C", model, *self.common())
        sv.instance("C_nopc", model, *self.common(), "--no-enable-prefix-caching")
        sv.gateway("G_C", "--both", sv.url("C"), "--protocol", "colocated")

    def start_set(self, model: Path, connector: str) -> None:
        store = self.work / f"ec-{connector}"
        store.mkdir(exist_ok=True)

        def ec(role: str) -> str:
            return json.dumps({"ec_connector": connector, "ec_role": role,
                               "ec_connector_extra_config": {"shared_storage_path": str(store)}})

        sv = self.set_servers
        sv.instance("E", model, *self.common(), "--role", "encode", "--ec-transfer-config", ec("ec_producer"))
        sv.instance("P", model, *self.common(), "--kv-transfer-config", H.kv_config("kv_producer"),
                    "--ec-transfer-config", ec("ec_consumer"))
        sv.instance("D", model, *self.common(), "--kv-transfer-config", H.kv_config("kv_consumer"),
                    "--ec-transfer-config", ec("ec_consumer"))
        sv.gateway("G", "--encode", sv.url("E"), "--prefill", sv.url("P"), "--decode", sv.url("D"),
                   "--protocol", "pull")
        print(f"  [{connector}] {self.servers.describe()}, {sv.describe()}", flush=True)

    # -- requests ---------------------------------------------------------------------------------------------
    def new_images(self, k: int) -> list[str]:
        urls = []
        for _ in range(k):
            self.seed += 1
            urls.append(png_data_url(self.seed, self.args.image_size))
        return urls

    def words(self, n: int = 6) -> str:
        return " ".join(self.gen.choice(WORDS) for _ in range(n))

    def body(self, images: list[str], before: str, after: str) -> dict:
        content: list[dict] = [{"type": "text", "text": before}]
        content += [{"type": "image_url", "image_url": {"url": u}} for u in images]
        content.append({"type": "text", "text": after})
        return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}],
                "max_tokens": self.args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "logprobs": True}

    def route(self, mode: str) -> tuple[str, str | None, list[str]]:
        if mode.startswith("C_gw"):
            return self.url("G_C"), "G_C", ["C"]
        if mode.startswith("C_nopc"):
            return self.url("C_nopc"), None, ["C_nopc"]
        if mode.startswith("C"):
            return self.url("C"), None, ["C"]
        return self.url("G"), "G", ["E", "P", "D"]

    def send(self, client, mode: str, body: dict) -> dict[str, Any]:
        url, gw, insts = self.route(mode)
        names = insts + ([gw] if gw else [])
        before = {n: H.scrape(client, self.url(n)) for n in names}
        self.contention.mark()
        t0 = time.monotonic()
        rid = f"bench-{uuid.uuid4().hex[:16]}"
        t1, text = H.stream_first(client, f"{url}/v1/chat/completions", body, {"X-Request-Id": rid})
        others = self.contention.since_mark()["others"]
        after = H.settle(client, {n: self.url(n) for n in names}, before, insts, gw)
        r: dict[str, Any] = {"ttft": t1 - t0, "others": others, "text": text}
        if gw == "G":  # E's own encode time, from its timeline of this request (absent on a gateway cache hit)
            ev = H.timeline_events(client, self.url("E"), rid)
            r["e_encode"] = H.first_event(ev, "encode_end") - H.first_event(ev, "encode_start")
        srv = "vllm:time_to_first_token_seconds_sum"
        for n in insts:
            a, b = after[n], before[n]
            if n == "E":
                r["e_runs"] = H.delta(a, b, "pdserve:encoder_runs_total")
                r["e_reused"] = H.delta(a, b, "pdserve:encode_reused_total")
                r["e_stores"] = H.delta(a, b, "pdserve:ec_stores_total")
                continue
            tag = "p" if n == "P" else "d" if n == "D" else "c"
            r[f"{tag}_srv"] = H.delta(a, b, srv)
            r[f"{tag}_enc_hits"] = H.delta(a, b, "pdserve:encoder_cache_hits_total")
            r[f"{tag}_enc_misses"] = H.delta(a, b, "pdserve:encoder_cache_misses_total")
            r[f"{tag}_ec_loads"] = H.delta(a, b, "pdserve:ec_loads_total")
            r[f"{tag}_ec_load_failures"] = H.delta(a, b, "pdserve:ec_load_failures_total")
            r[f"{tag}_prefix_hit_tokens"] = H.delta(a, b, "vllm:prefix_cache_hits_total")
            r[f"{tag}_prompt_tokens_computed"] = H.delta(a, b, "pdserve:prompt_tokens_computed_total")
            r[f"{tag}_prompt_tokens"] = H.delta(a, b, "vllm:prompt_tokens_total")
        if gw:
            a, b = after[gw], before[gw]
            for outcome in ("encoded", "cache_hit", "failed"):
                r[f"gw_{outcome}"] = H.delta(a, b, f"pdserve:gateway_encode_items_total|outcome={outcome}")
            r.update(H.leg_means(a, b))
            if "gw_kv_ready" in r and "gw_prefill" in r:
                r["gw_before_P"] = r["gw_kv_ready"] - r["gw_prefill"]
        return r

    # -- a set ------------------------------------------------------------------------------------------------
    def run_set(self, client, connector: str) -> dict[str, Any]:
        a = self.args
        t = time.monotonic()
        # Correctness: the same request through E->P->D and C gives the same tokens (new images, then again).
        agree = []
        for k in a.images:
            imgs = self.new_images(k)
            for _ in range(2):
                body = self.body(imgs, "look:", self.words())
                texts = [self.send(client, mode, body)["text"] for mode in ("epd_new", "C_new")]
                agree.append((k, texts[0] == texts[1]))
        for _ in range(a.warmup):
            for k in a.images:
                self.one_rep(client, k, record=None)
        print(f"  [{connector}] E->P->D == C (tokens): {agree}; warm-up {time.monotonic() - t:.1f} s", flush=True)
        samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
        order_rng = random.Random(7)
        for rep in range(a.reps):
            ks = list(a.images)
            order_rng.shuffle(ks)
            for k in ks:
                if a.wait_idle > 0:
                    self.contention.wait_for_quiet(a.wait_idle)
                self.one_rep(client, k, record=samples, rep=rep, rng=order_rng)
            print(f"  [{connector}] rep {rep + 1}/{a.reps} | load {H.loadavg()}", flush=True)
        return summarize(connector, a, samples, agree)

    def one_rep(self, client, k: int, record, rep: int = -1, rng: random.Random | None = None) -> None:
        rng = rng or random.Random(rep)
        new = list(NEW_MODES)
        hits = list(HIT_MODES)
        rng.shuffle(new)
        rng.shuffle(hits)
        images: dict[str, list[str]] = {}
        for mode in new:
            images[mode] = self.new_images(k)
            time.sleep(0.02)
            r = self.send(client, mode, self.body(images[mode], "look:", self.words()))
            if record is not None:
                r["rep"] = rep
                record.setdefault((mode, k), []).append(r)
        for mode in hits:
            base = images[HIT_OF[mode]]
            body = (self.body(base, f"{self.words()} look:", "describe") if mode == "epd_hit_pre"
                    else self.body(base, "look:", self.words()))
            time.sleep(0.02)
            r = self.send(client, mode, body)
            if record is not None:
                r["rep"] = rep
                record.setdefault((mode, k), []).append(r)


def summarize(connector: str, args, samples, agree) -> dict[str, Any]:
    res: dict[str, Any] = {"connector": connector, "agree": agree, "rows": [],
                           "samples": {f"{m}/{k}": v for (m, k), v in samples.items()}}
    modes = list(NEW_MODES) + list(HIT_MODES)
    for k in args.images:
        reps = sorted({r["rep"] for m in modes for r in samples.get((m, k), [])})
        noisy = {r["rep"] for m in modes for r in samples.get((m, k), []) if r["others"] >= H.QUIET_CORES}
        quiet = [r for r in reps if r not in noisy]
        keep = set(quiet) if len(quiet) >= max(3, len(reps) // 2) else set(reps)
        by = {m: [r for r in samples.get((m, k), []) if r["rep"] in keep] for m in modes}
        row: dict[str, Any] = {"images": k, "reps_kept": len(keep), "reps": len(reps),
                               "quiet_only": keep == set(quiet),
                               "others_median": H.median([r["others"] for m in modes for r in samples.get((m, k), [])]),
                               "others_max": max((r["others"] for m in modes for r in samples.get((m, k), [])),
                                                 default=0.0)}
        for m in modes:
            row[f"{m}_ms"] = H.median([r["ttft"] for r in by[m]]) * 1e3
            row[f"{m}_all_ms"] = [round(r["ttft"] * 1e3, 2) for r in by[m]]
            for key in sorted({kk for r in by[m] for kk in r if kk not in ("ttft", "others", "text", "rep")}):
                vals = [r[key] for r in by[m] if key in r]
                scale = 1e3 if key.endswith(("_srv", "_prefill", "_kv_ready", "_decode_first_token", "_before_P",
                                              "_encode")) else 1
                row[f"{m}:{key}"] = H.median(vals) * scale

        def paired(a: str, b: str, ratio: bool, by=by) -> float:
            rb = {r["rep"]: r for r in by[b]}
            xs = [(r["ttft"] / rb[r["rep"]]["ttft"]) if ratio else (r["ttft"] - rb[r["rep"]]["ttft"]) * 1e3
                  for r in by[a] if r["rep"] in rb]
            return H.median(xs)

        for a_, b_ in (("epd_new", "C_gw_new"), ("epd_new", "C_new"), ("C_gw_new", "C_new"),
                       ("epd_hit", "epd_new"), ("epd_hit_pre", "epd_new"), ("C_hit", "C_new"),
                       ("C_nopc_hit", "C_nopc_new"), ("epd_hit", "C_hit"), ("epd_hit_pre", "C_nopc_hit")):
            row[f"{a_}/{b_}"] = row[f"{a_}_ms"] / row[f"{b_}_ms"]
            row[f"{a_}/{b_} paired"] = paired(a_, b_, True)
            row[f"{a_}-{b_} ms paired"] = paired(a_, b_, False)
        res["rows"].append(row)
    return res


def print_set(res: dict[str, Any], args) -> None:
    fmt = H.fmt
    print(f"\n== TTFT, tiny LLaVA, {res['connector']}, images {args.image_size}x{args.image_size} PNG | medians (ms) "
          "of the kept reps; send -> first streamed token")
    print(f"  {'imgs':>4} {'C_new':>7} {'C_gw_new':>8} {'epd_new':>7} {'C_hit':>7} {'C_nopc_new':>10} "
          f"{'C_nopc_hit':>10} {'epd_hit':>7} {'epd_hit_pre':>11} {'epd/C_gw':>8} {'epd/C':>6} {'C_gw/C':>6} "
          f"{'reps':>6} {'others':>10}")
    for r in res["rows"]:
        print(f"  {r['images']:>4} {r['C_new_ms']:>7.1f} {r['C_gw_new_ms']:>8.1f} {r['epd_new_ms']:>7.1f} "
              f"{r['C_hit_ms']:>7.1f} {r['C_nopc_new_ms']:>10.1f} {r['C_nopc_hit_ms']:>10.1f} {r['epd_hit_ms']:>7.1f} "
              f"{r['epd_hit_pre_ms']:>11.1f} {r['epd_new/C_gw_new']:>8.2f} {r['epd_new/C_new']:>6.2f} "
              f"{r['C_gw_new/C_new']:>6.2f} {r['reps_kept']:>3}/{r['reps']:<2}{'q' if r['quiet_only'] else '!'} "
              f"{r['others_median']:.2f}/{r['others_max']:.2f}")
    print("  paired (median over reps of the same rep's ratio; difference in ms):")
    for r in res["rows"]:
        for pair in ("epd_new/C_gw_new", "epd_new/C_new", "C_gw_new/C_new"):
            a_, b_ = pair.split("/")
            print(f"  {r['images']:>4} img {pair:<18} {r[pair + ' paired']:.2f} ({r[f'{a_}-{b_} ms paired']:+.1f} ms)")
    print("  time saved by a hit (new -> seen images; paired difference, ms; ratio hit/new):")
    for r in res["rows"]:
        for pair, what in (("epd_hit/epd_new", ("E->P->D, text after varied (gateway cache hit + P encoder cache "
                                                "+ P prefix cache)")),
                           ("epd_hit_pre/epd_new", "E->P->D, text before varied (no KV prefix can match)"),
                           ("C_hit/C_new", "C, text after varied (encoder cache + prefix cache)"),
                           ("C_nopc_hit/C_nopc_new", "C without prefix caching (encoder cache only)")):
            a_, b_ = pair.split("/")
            print(f"  {r['images']:>4} img {pair:<22} {r[f'{a_}-{b_} ms paired']:+7.2f} ms  x{r[pair + ' paired']:.2f}"
                  f"   {what}")
    print("  checks and breakdown (medians per request): gw enc/hit = gateway encode_items encoded/cache_hit; E runs = "
          "E's encoder_runs; enc h/m = encoder cache hits/misses on P or C; ec = ec_loads; pfx = prefix-cache hit "
          "tokens; srv = own TTFT; gw<P = gateway time before the P leg (encode fan-out); E enc = E's timeline "
          "encode_start -> encode_end")
    print(f"  {'imgs':>4} {'mode':<12} {'TTFT':>6} {'gw enc/hit':>10} {'E runs':>6} {'enc h/m':>8} {'ec':>4} "
          f"{'pfx':>5} {'computed':>8} {'srv':>6} {'D srv':>6} {'gw<P':>6} {'gw prefill':>10} {'gw D 1st':>8} "
          f"{'E enc':>6}")
    for r in res["rows"]:
        k = r["images"]
        for m in list(NEW_MODES) + list(HIT_MODES):
            def g(key: str, r=r, m=m) -> float:
                return r.get(f"{m}:{key}", float("nan"))
            tag = "p" if m.startswith("epd") else "c"
            print(f"  {k:>4} {m:<12} {r[f'{m}_ms']:>6.1f} {fmt(g('gw_encoded'), '.0f'):>4}/"
                  f"{fmt(g('gw_cache_hit'), '.0f'):<5} {fmt(g('e_runs'), '.0f'):>6} "
                  f"{fmt(g(f'{tag}_enc_hits'), '.0f'):>3}/{fmt(g(f'{tag}_enc_misses'), '.0f'):<4} "
                  f"{fmt(g(f'{tag}_ec_loads'), '.0f'):>4} {fmt(g(f'{tag}_prefix_hit_tokens'), '.0f'):>5} "
                  f"{fmt(g(f'{tag}_prompt_tokens_computed'), '.0f'):>8} {fmt(g(f'{tag}_srv'), '.1f'):>6} "
                  f"{fmt(g('d_srv'), '.1f'):>6} {fmt(g('gw_before_P'), '.1f'):>6} {fmt(g('gw_prefill'), '.1f'):>10} "
                  f"{fmt(g('gw_decode_first_token'), '.1f'):>8} {fmt(g('e_encode'), '.1f'):>6}")
    print(f"  E->P->D tokens equal C's (same request): {res['agree']}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 reps, one warm-up, ECStorageConnector only")
    ap.add_argument("--json", help="write all numbers here")
    ap.add_argument("--connectors", default=",".join(CONNECTORS))
    ap.add_argument("--images", default="1,4", help="images per request, one row each")
    ap.add_argument("--image-size", type=int, default=336, help="square PNG side in pixels (resized to 32 by P/E/C)")
    ap.add_argument("--reps", type=int, default=None, help="default 9; quick 3")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up rounds of every mode (default 2)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-blocks", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--wait-idle", type=float, default=3.0,
                    help="before each (rep, images), wait up to S s for other processes to use < 0.25 cores")
    args = ap.parse_args(argv)
    args.connectors = [c for c in args.connectors.split(",") if c]
    unknown = set(args.connectors) - set(CONNECTORS)
    if unknown:
        ap.error(f"unknown connectors {sorted(unknown)}; known: {CONNECTORS}")
    args.images = [int(x) for x in args.images.split(",")]
    if args.quick:
        args.reps = args.reps or 3
        args.warmup = 1 if args.warmup is None else args.warmup
        if args.connectors == list(CONNECTORS):
            args.connectors = ["ECStorageConnector"]
        args.wait_idle = min(args.wait_idle, 1.0)
    args.reps = args.reps or 9
    args.warmup = 2 if args.warmup is None else args.warmup
    return args


def main(argv: list[str] | None = None) -> int:
    from pdserve.modelgen.llava import make_llava_model

    args = parse_args(argv)
    cleanup, meter = H.Cleanup(), H.CpuMeter()
    work = cleanup.work_dir("epd")
    results: dict[str, Any] = {"args": vars(args), "load_before": H.loadavg(), "sets": []}
    print(f"bench/epd.py | connectors {args.connectors} | images {args.images} of {args.image_size} px | "
          f"{args.reps} reps | load {results['load_before']}", flush=True)
    t_start = time.monotonic()
    try:
        model = make_llava_model(work / "tiny-llava")
        b = Bench(args, work, cleanup, meter)
        results["data_url_KiB"] = len(png_data_url(1, args.image_size)) / 1024
        print(f"  tiny LLaVA at {model}; one image data URL is {results['data_url_KiB']:.0f} KiB", flush=True)
        with H.http_client(120) as client:
            b.start_shared(model)
            for connector in args.connectors:
                b.start_set(model, connector)
                results["sets"].append(b.run_set(client, connector))
                b.set_servers.stop()
                print_set(results["sets"][-1], args)
    finally:
        cleanup.run()
    results["load_after"] = H.loadavg()
    results["wall_s"] = time.monotonic() - t_start
    print("\n== Summary (TTFT medians, ms; ratios of medians, paired in parentheses)")
    for res in results["sets"]:
        for r in res["rows"]:
            print(f"  {res['connector']:<18} {r['images']} img: E->P->D {r['epd_new_ms']:.1f} vs C {r['C_new_ms']:.1f} "
                  f"(via gateway {r['C_gw_new_ms']:.1f}): E->P->D/C_gw {r['epd_new/C_gw_new']:.2f} "
                  f"({r['epd_new/C_gw_new paired']:.2f}), E->P->D/C {r['epd_new/C_new']:.2f} "
                  f"({r['epd_new/C_new paired']:.2f}) | hit saves: E->P->D {-r['epd_hit-epd_new ms paired']:.1f} ms "
                  f"(text-before {-r['epd_hit_pre-epd_new ms paired']:.1f}), C {-r['C_hit-C_new ms paired']:.1f} ms, "
                  f"C no-prefix-cache {-r['C_nopc_hit-C_nopc_new ms paired']:.1f} ms")
    print(f"  load {results['load_before']} -> {results['load_after']}; wall {results['wall_s']:.0f} s")
    H.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
