"""TTFT of E->P->D against colocated for 1 and 4 images, and the time an encoder-cache hit saves, in one run.

Issue: "TTFT of E->P->D against colocated for 1 and 4 images, and the time saved by an encoder-cache hit."

Model: the tiny LLaVA of pdserve.modelgen.llava (CLIP tower 64 wide, 2 layers, 32x32 input, 16 image tokens per
image; Llama text model 128 wide, 2 layers). Images: seeded random RGB pixels, PNG data URLs (--image-size, default
336x336, which the processor resizes to 32x32). Chat requests: [text, image x k, text], max_tokens 8, greedy,
streamed, `logprobs: true` (so every token gets its own chunk); TTFT = send -> first streamed token chunk (the
role chunk is skipped).

Processes, all real: per EC connector (ECStorageConnector: E writes safetensors to a shared folder; ECP2PConnector:
E keeps outputs in memory and P fetches them over ZMQ) an encode instance E (ec_producer), P (kv_producer +
ec_consumer) and D (kv_consumer + ec_consumer), and a gateway `--encode E --prefill P --decode D --protocol pull`;
shared by all sets: C (colocated), C_nopc (colocated, --no-enable-prefix-caching) and a gateway
`--protocol colocated --both C` (C_gw: the same number of HTTP hops as E->P->D's client sees).
Modes per k in {1, 4} (every "new" mode gets its own never-seen images; each "hit" mode repeats the images of its
"new" mode, in the same rep, after all new modes ran; orders shuffled each rep):
  C_new, C_gw_new, C_nopc_new, epd_new             new images;
  C_hit                                            C again, same images, different text AFTER them (encoder-cache
                                                   hit, and the blocks before the text can be KV prefix-cache hits);
  C_nopc_hit                                       the same on C_nopc (encoder cache only: no prefix caching);
  epd_hit                                          E->P->D again, same images, different text after them (gateway
                                                   cache hit: E not called; P's encoder cache and prefix cache);
  epd_hit_pre                                      E->P->D again, same images, different text BEFORE them (no KV
                                                   prefix can match: encoder-side reuse only).
Checks per request from /metrics deltas: the gateway's encode_items (encoded / cache_hit / failed), E's
encoder_runs (0 on a hit), P's / C's encoder_cache_hits and misses, ec_loads, prefix_cache_hits; breakdown: the
gateway's legs (prefill, kv_ready; kv_ready - prefill = time before P is called, i.e. the encode fan-out), each
instance's own vllm:time_to_first_token_seconds.

--profile traces every process (bench/procs.py's engine hooks plus stamps defined here: prompt building with image
decoding, EC save / load, the vision encoder, the encode endpoint, and the gateway's encode fan-out and legs; no
pdserve code changes) and prints each mode's request time line.

  .venv/bin/python bench/epd.py --quick
  .venv/bin/python bench/epd.py --json /tmp/epd.json
  .venv/bin/python bench/epd.py --connectors ECP2PConnector --image-size 64
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")
_BENCH = Path(__file__).resolve().parent
if str(_BENCH) not in sys.path:
    sys.path.insert(0, str(_BENCH))
import procs
import transfer as tr
from ttft import delta, scrape

QUIET_CORES = 0.3
MODEL_NAME = "llava"
CONNECTORS = ("ECStorageConnector", "ECP2PConnector")
NEW_MODES = ("C_new", "C_gw_new", "C_nopc_new", "epd_new")
HIT_MODES = ("C_hit", "C_nopc_hit", "epd_hit", "epd_hit_pre")
HIT_OF = {"C_hit": "C_new", "C_nopc_hit": "C_nopc_new", "epd_hit": "epd_new", "epd_hit_pre": "epd_new"}
median = tr.median
WORDS = ("red", "blue", "cat", "dog", "tree", "house", "car", "sky", "river", "stone", "bird", "road", "light",
         "small", "large", "old", "new", "quick", "slow", "green")


# ============================================================================= tracing (children, --profile)

_SITE = """\
import os, sys
sys.path.insert(0, {bench!r})
import procs as _p
if os.environ.get("PDSERVE_BENCH_ENGINE_TRACE"):
    _p.install_trace(os.environ["PDSERVE_BENCH_ENGINE_TRACE"])
import epd as _e
_e.install_child_hooks(os.environ["PDSERVE_BENCH_EPD_TRACE"])
del sys.path[0]
"""


def child_env(work: Path, name: str, engine: bool) -> dict[str, str]:
    site = work / "epd-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITE.format(bench=str(_BENCH)))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p),
           "PDSERVE_BENCH_EPD_TRACE": str(work / f"epd-{name}.jsonl")}
    if engine:
        env["PDSERVE_BENCH_ENGINE_TRACE"] = str(work / f"trace-{name}.jsonl")
    return env


def install_child_hooks(path: str) -> None:
    """Stamp the multimodal path of an instance, or the gateway's encode fan-out and legs (whichever is loaded)."""
    tracer = procs._Tracer(path)
    stamp, stamp_async = procs.stampers(tracer)

    from pdserve.ec_transfer.base import ECConnector
    from pdserve.ec_transfer.p2p import ECP2PConnector
    from pdserve.ec_transfer.storage import ECStorageConnector
    from pdserve.gateway.call import Call
    from pdserve.gateway.encode import EncodeFanout
    from pdserve.models.llava import LlavaVision
    from pdserve.multimodal.prompt import MultimodalPrompter
    from pdserve.server.encode_serving import EncodeServing

    stamp(MultimodalPrompter, "build", "mm_build")
    stamp(MultimodalPrompter, "image_parts", "mm_decode", lambda self, messages: {})
    stamp(ECConnector, "load", "ec_load")
    for cls in (ECStorageConnector, ECP2PConnector):
        stamp(cls, "save", "ec_save")
    stamp(LlavaVision, "encode", "vision_encode", lambda self, pixels: {"n": int(pixels.shape[0])})
    stamp_async(EncodeServing, "chat", "encode_chat")
    stamp_async(EncodeFanout, "prepare", "gw_prepare")
    stamp_async(EncodeFanout, "_encode_one", "gw_encode_one")
    stamp_async(Call, "call_json", "gw_call_json", lambda self, leg, *a, **k: {"leg": leg})
    orig_send = Call._send

    async def _send(self, leg, instance, body, header_timeout):
        tracer.ev("gw_send", leg=leg)
        return await orig_send(self, leg, instance, body, header_timeout)
    Call._send = _send


def png_data_url(seed: int, size: int) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def stream_first_chat(client, url: str, body: dict) -> tuple[float, str]:
    """POST a streamed chat completion; returns (monotonic time of the first token chunk, the whole text)."""
    first_t, text = None, []
    for t, data in procs.sse_data(client, f"{url}/v1/chat/completions", body):
        obj = json.loads(data)
        if "choices" not in obj:
            raise RuntimeError(f"{url}: error in stream: {data[:500]}")
        if not obj["choices"]:
            continue
        ch = obj["choices"][0]
        content = (ch.get("delta") or {}).get("content")
        if first_t is None and (ch.get("logprobs") or content or ch.get("finish_reason")):
            first_t = t  # the role chunk (empty content, no logprobs) is not a token
        if content:
            text.append(content)
    if first_t is None:
        raise RuntimeError(f"{url}: the stream had no token")
    return first_t, "".join(text)


class Bench:
    def __init__(self, args, work: Path, contention: procs.Contention) -> None:
        self.args, self.work, self.contention = args, work, contention
        self.procs: dict[str, Any] = {}
        self.seed = 1000
        self.gen = random.Random(99)
        self.url_cache: dict[int, str] = {}

    def _start(self, key: str, fn, *a, **k) -> Any:
        proc = fn(*a, **k)
        self.procs[key] = proc
        tr._CLEANUP.append(proc.stop)
        self.contention.pids.append(proc.pid)
        return proc

    def env(self, name: str, engine: bool = True, connector: str = "") -> dict[str, str] | None:
        if not self.args.profile:
            return None
        return child_env(self.work, f"{name}{'-' + connector if connector else ''}", engine)

    def common(self) -> list[str]:
        a = self.args
        return ["--max-model-len", str(a.max_model_len), "--num-kv-blocks", str(a.kv_blocks), "--threads",
                str(a.threads), "--served-model-name", MODEL_NAME, "--log-level", "warning"]

    def start_shared(self, model: Path) -> None:
        from pdserve.launcher import start, start_instance

        self._start("C", start_instance, model, *self.common(), name="C", timeout=180, env=self.env("C"))
        self._start("C_nopc", start_instance, model, *self.common(), "--no-enable-prefix-caching", name="C_nopc",
                    timeout=180, env=self.env("C_nopc"))
        self._start("G_C", start, "G_C", ["gateway", "--both", self.procs["C"].url, "--protocol", "colocated",
                                          "--port", "0", "--log-level", "warning"], env=self.env("G_C", engine=False))

    def start_set(self, model: Path, connector: str) -> None:
        from pdserve.launcher import start, start_instance

        store = self.work / f"ec-{connector}"
        store.mkdir(exist_ok=True)

        def ec(role: str) -> str:
            return json.dumps({"ec_connector": connector, "ec_role": role,
                               "ec_connector_extra_config": {"shared_storage_path": str(store)}})

        def kv(role: str) -> str:
            return json.dumps({"kv_connector": "PdConnector", "kv_role": role})

        self._start("E", start_instance, model, *self.common(), "--role", "encode", "--ec-transfer-config",
                    ec("ec_producer"), name=f"E-{connector}", timeout=180, env=self.env("E", True, connector))
        self._start("P", start_instance, model, *self.common(), "--kv-transfer-config", kv("kv_producer"),
                    "--ec-transfer-config", ec("ec_consumer"), name=f"P-{connector}", timeout=180,
                    env=self.env("P", True, connector))
        self._start("D", start_instance, model, *self.common(), "--kv-transfer-config", kv("kv_consumer"),
                    "--ec-transfer-config", ec("ec_consumer"), name=f"D-{connector}", timeout=180,
                    env=self.env("D", True, connector))
        self._start("G", start, f"G-{connector}", [
            "gateway", "--encode", self.procs["E"].url, "--prefill", self.procs["P"].url, "--decode",
            self.procs["D"].url, "--protocol", "pull", "--port", "0", "--log-level", "warning"],
                    env=self.env("G", False, connector))
        print(f"  [{connector}] " + ", ".join(f"{n} pid {p.pid}" for n, p in self.procs.items()), flush=True)

    def stop_set(self) -> None:
        for key in ("G", "D", "P", "E"):
            proc = self.procs.pop(key, None)
            if proc is not None:
                proc.stop()

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
            return self.procs["G_C"].url, "G_C", ["C"]
        if mode.startswith("C_nopc"):
            return self.procs["C_nopc"].url, None, ["C_nopc"]
        if mode.startswith("C"):
            return self.procs["C"].url, None, ["C"]
        return self.procs["G"].url, "G", ["E", "P", "D"]

    def send(self, client, mode: str, body: dict) -> dict[str, Any]:
        url, gw, insts = self.route(mode)
        names = insts + ([gw] if gw else [])
        before = {n: scrape(client, self.procs[n].url) for n in names}
        self.contention.mark()
        t0 = time.monotonic()
        t1, text = stream_first_chat(client, url, body)
        others = self.contention.since_mark()["others"]
        deadline = time.monotonic() + 5
        while True:  # let P's lease end and the gateway observe the request before the next one starts
            after = {n: scrape(client, self.procs[n].url) for n in names}
            settled = all(after[n].get("pdserve:num_requests_held", 0) == 0
                          and after[n].get("pdserve:kv_leases_held", 0) == 0 for n in insts)
            if gw:
                settled = settled and sum(delta(after[gw], before[gw], k) for k in after[gw]
                                          if k.startswith("pdserve:gateway_requests_total")) >= 1
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        r: dict[str, Any] = {"ttft": t1 - t0, "others": others, "text": text, "t0": t0, "t1": t1}
        srv = "vllm:time_to_first_token_seconds_sum"
        for n in insts:
            a, b = after[n], before[n]
            if n == "E":
                r["e_runs"] = delta(a, b, "pdserve:encoder_runs_total")
                r["e_reused"] = delta(a, b, "pdserve:encode_reused_total")
                r["e_stores"] = delta(a, b, "pdserve:ec_stores_total")
                continue
            tag = "p" if n == "P" else "d" if n == "D" else "c"
            r[f"{tag}_srv"] = delta(a, b, srv)
            r[f"{tag}_enc_hits"] = delta(a, b, "pdserve:encoder_cache_hits_total")
            r[f"{tag}_enc_misses"] = delta(a, b, "pdserve:encoder_cache_misses_total")
            r[f"{tag}_ec_loads"] = delta(a, b, "pdserve:ec_loads_total")
            r[f"{tag}_ec_load_failures"] = delta(a, b, "pdserve:ec_load_failures_total")
            r[f"{tag}_prefix_hit_tokens"] = delta(a, b, "vllm:prefix_cache_hits_total")
            r[f"{tag}_prompt_tokens_computed"] = delta(a, b, "pdserve:prompt_tokens_computed_total")
            r[f"{tag}_prompt_tokens"] = delta(a, b, "vllm:prompt_tokens_total")
        if gw:
            a, b = after[gw], before[gw]
            for outcome in ("encoded", "cache_hit", "failed"):
                r[f"gw_{outcome}"] = delta(a, b, f"pdserve:gateway_encode_items_total|outcome={outcome}")
            for leg in ("prefill", "kv_ready", "decode_first_token", "e2e"):
                n = delta(a, b, f"pdserve:gateway_leg_seconds_count|leg={leg}")
                if n:
                    r[f"gw_{leg}"] = delta(a, b, f"pdserve:gateway_leg_seconds_sum|leg={leg}") / n
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
                agree.append((k, self.send(client, "epd_new", body)["text"] == self.send(client, "C_new", body)["text"]))
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
            print(f"  [{connector}] rep {rep + 1}/{a.reps} | load {procs.loadavg()}", flush=True)
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
        if record is not None:  # E alone: one new image, posted straight to E as the gateway does, then again
            e_img = self.new_images(1)
            for key in ("E_direct_new", "E_direct_seen"):
                t0 = time.monotonic()
                resp = client.post(f"{self.procs['E'].url}/v1/chat/completions",
                                   json={"model": MODEL_NAME, "messages": [{"role": "user", "content": [
                                       {"type": "image_url", "image_url": {"url": e_img[0]}}]}]})
                if resp.status_code != 200:
                    raise RuntimeError(f"E: HTTP {resp.status_code}: {resp.text[:300]}")
                record.setdefault((key, k), []).append({"ttft": time.monotonic() - t0, "others": 0.0, "rep": rep})
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
        noisy = {r["rep"] for m in modes for r in samples.get((m, k), []) if r["others"] >= QUIET_CORES}
        quiet = [r for r in reps if r not in noisy]
        keep = set(quiet) if len(quiet) >= max(3, len(reps) // 2) else set(reps)
        by = {m: [r for r in samples.get((m, k), []) if r["rep"] in keep] for m in modes}
        row: dict[str, Any] = {"images": k, "reps_kept": len(keep), "reps": len(reps),
                               "quiet_only": keep == set(quiet),
                               "others_median": median([r["others"] for m in modes for r in samples.get((m, k), [])]),
                               "others_max": max((r["others"] for m in modes for r in samples.get((m, k), [])),
                                                 default=0.0)}
        for m in modes:
            row[f"{m}_ms"] = median([r["ttft"] for r in by[m]]) * 1e3
            row[f"{m}_all_ms"] = [round(r["ttft"] * 1e3, 2) for r in by[m]]
            for key in sorted({kk for r in by[m] for kk in r if kk not in ("ttft", "others", "text", "rep", "t0", "t1")}):
                vals = [r[key] for r in by[m] if key in r]
                scale = 1e3 if key.endswith(("_srv", "_prefill", "_kv_ready", "_decode_first_token", "_e2e",
                                              "_before_P")) else 1
                row[f"{m}:{key}"] = median(vals) * scale

        def paired(a: str, b: str, ratio: bool, by=by) -> float:
            rb = {r["rep"]: r for r in by[b]}
            xs = [(r["ttft"] / rb[r["rep"]]["ttft"]) if ratio else (r["ttft"] - rb[r["rep"]]["ttft"]) * 1e3
                  for r in by[a] if r["rep"] in rb]
            return median(xs)

        for a_, b_ in (("epd_new", "C_gw_new"), ("epd_new", "C_new"), ("C_gw_new", "C_new"),
                       ("epd_hit", "epd_new"), ("epd_hit_pre", "epd_new"), ("C_hit", "C_new"),
                       ("C_nopc_hit", "C_nopc_new"), ("epd_hit", "C_hit"), ("epd_hit_pre", "C_nopc_hit")):
            row[f"{a_}/{b_}"] = row[f"{a_}_ms"] / row[f"{b_}_ms"]
            row[f"{a_}/{b_} paired"] = paired(a_, b_, True)
            row[f"{a_}-{b_} ms paired"] = paired(a_, b_, False)
        for key in ("E_direct_new", "E_direct_seen"):
            row[f"{key}_ms"] = median([r["ttft"] for r in samples.get((key, k), []) if r["rep"] in keep]) * 1e3
        res["rows"].append(row)
    return res


def print_set(res: dict[str, Any], args) -> None:
    fmt = tr.fmt
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
          "tokens; srv = own TTFT; gw<P = gateway time before the P leg (encode fan-out)")
    print(f"  {'imgs':>4} {'mode':<12} {'TTFT':>6} {'gw enc/hit':>10} {'E runs':>6} {'enc h/m':>8} {'ec':>4} "
          f"{'pfx':>5} {'computed':>8} {'srv':>6} {'D srv':>6} {'gw<P':>6} {'gw prefill':>10} {'gw D 1st':>8}")
    for r in res["rows"]:
        k = r["images"]
        for m in list(NEW_MODES) + list(HIT_MODES):
            def g(key: str, r=r, m=m) -> float:
                return r.get(f"{m}:{key}", float("nan"))
            tag = "p" if m.startswith("epd") else "c"
            print(f"  {k:>4} {m:<12} {r[f'{m}_ms']:>6.1f} {fmt(g('gw_encoded'), '.0f'):>4}/{fmt(g('gw_cache_hit'), '.0f'):<5} "
                  f"{fmt(g('e_runs'), '.0f'):>6} {fmt(g(f'{tag}_enc_hits'), '.0f'):>3}/{fmt(g(f'{tag}_enc_misses'), '.0f'):<4} "
                  f"{fmt(g(f'{tag}_ec_loads'), '.0f'):>4} {fmt(g(f'{tag}_prefix_hit_tokens'), '.0f'):>5} "
                  f"{fmt(g(f'{tag}_prompt_tokens_computed'), '.0f'):>8} {fmt(g(f'{tag}_srv'), '.1f'):>6} "
                  f"{fmt(g('d_srv'), '.1f'):>6} {fmt(g('gw_before_P'), '.1f'):>6} {fmt(g('gw_prefill'), '.1f'):>10} "
                  f"{fmt(g('gw_decode_first_token'), '.1f'):>8}")
    print("  E alone (one 1-image request posted straight to E, median ms): " + "; ".join(
        f"new image {r['E_direct_new_ms']:.1f}, seen image {r['E_direct_seen_ms']:.1f}" for r in res["rows"][:1]))
    print(f"  E->P->D tokens equal C's (same request): {res['agree']}")


def pixel_costs(model: Path, size: int, images: list[int]) -> dict[str, float]:
    """In this process: what every instance that builds the prompt spends per request outside the model."""
    import msgspec

    from pdserve.models.image_processor import load_image_processor
    from pdserve.multimodal.media import MediaPolicy, load_image

    proc = load_image_processor(model)
    url = png_data_url(7, size)
    policy = MediaPolicy()

    def best(fn, n=15) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return median(times) * 1e3

    out = {"decode_ms": best(lambda: load_image(url, policy)),
           "preprocess_ms": best(lambda: proc(load_image(url, policy))) - 0.0}
    out["preprocess_ms"] -= out["decode_ms"]
    for k in images:
        raw = json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]
                                        * k}]}).encode()
        out[f"json_parse_{k}img_ms"] = best(lambda raw=raw: msgspec.json.decode(raw))
    return out


def _segments(mode: str, r: dict, ev: dict[str, list[dict]]) -> dict[str, float] | None:
    t0, t1 = r["t0"], r["t1"]
    win = {k: [e for e in v if t0 <= e["t"] <= t1] for k, v in ev.items()}

    def first(name: str, who: str, after: float = float("-inf"), pred=lambda e: True):
        return next((e for e in win.get(who, []) if e["ev"] == name and e["t"] >= after and pred(e)), None)

    def end(e) -> float:
        return e["t"] + e.get("dur", 0.0)

    if mode.startswith("C"):
        who = "C_nopc" if mode.startswith("C_nopc") else "C"
        build, add = first("mm_build", who), first("add", who)
        if not build or not add:
            return None
        deliver = first("deliver", who, add["t"])
        steps = [e for e in win.get(who, []) if e["ev"] == "step" and deliver and e["t"] <= deliver["t"]]
        enc = [e for e in win.get(who, []) if e["ev"] == "vision_encode"]
        if not deliver or not steps:
            return None
        return {"client -> prompt build start (HTTP, JSON)": build["t"] - t0,
                "prompt build (decode + preprocess images)": build["dur"],
                "  of which image decode": sum(e["dur"] for e in win.get(who, []) if e["ev"] == "mm_decode"),
                "build end -> engine add": add["t"] - end(build),
                "add -> first step": steps[0]["t"] - add["t"],
                "prefill steps (first start -> first token delivered)": deliver["t"] - steps[0]["t"],
                "  of which vision encoder": sum(e["dur"] for e in enc),
                "deliver -> client has token": t1 - deliver["t"], "total (client)": t1 - t0}
    prep = first("gw_prepare", "G")
    if prep is None:
        return None
    p_send = first("gw_send", "G", pred=lambda e: e.get("leg") == "prefill")
    d_send = first("gw_send", "G", pred=lambda e: e.get("leg") == "decode")
    p_build, p_add = first("mm_build", "P"), first("add", "P")
    d_build, d_add = first("mm_build", "D"), first("add", "D")
    if not all((p_send, d_send, p_build, p_add, d_build, d_add)):
        return None
    p_deliver = first("deliver", "P", p_add["t"])
    d_deliver = first("deliver", "D", d_add["t"])
    if not p_deliver or not d_deliver:
        return None
    p_steps = [e for e in win.get("P", []) if e["ev"] == "step" and e["t"] <= p_deliver["t"]]
    chats = [e for e in win.get("E", []) if e["ev"] == "encode_chat"]
    seg = {"client -> gateway encode fan-out start": prep["t"] - t0,
           "gateway encode fan-out (all E calls)": prep["dur"],
           "  E: /chat handler per image (median)": median([e["dur"] for e in chats]) if chats else float("nan"),
           "  E: image decode, sum": sum(e["dur"] for e in win.get("E", []) if e["ev"] == "mm_decode"),
           "  E: vision encoder, sum": sum(e["dur"] for e in win.get("E", []) if e["ev"] == "vision_encode"),
           "  E: EC save, sum": sum(e["dur"] for e in win.get("E", []) if e["ev"] == "ec_save"),
           "fan-out end -> P leg sent": p_send["t"] - end(prep),
           "P leg sent -> P prompt build start (HTTP, JSON)": p_build["t"] - p_send["t"],
           "P prompt build (decode + preprocess images)": p_build["dur"],
           "P build end -> engine add": p_add["t"] - end(p_build),
           "P add -> first step": (p_steps[0]["t"] - p_add["t"]) if p_steps else float("nan"),
           "P prefill steps (first start -> token delivered)": (p_deliver["t"] - p_steps[0]["t"]) if p_steps
           else float("nan"),
           "  P: EC loads, sum": sum(e["dur"] for e in win.get("P", []) if e["ev"] == "ec_load"),
           "  P: vision encoder (local), sum": sum(e["dur"] for e in win.get("P", []) if e["ev"] == "vision_encode"),
           "P deliver -> D leg sent (P answer, gateway)": d_send["t"] - p_deliver["t"],
           "D leg sent -> D prompt build start (HTTP, JSON)": d_build["t"] - d_send["t"],
           "D prompt build (decode + preprocess images, unused)": d_build["dur"],
           "D build end -> engine add": d_add["t"] - end(d_build),
           "D add -> first token delivered (KV pull + 1-token step)": d_deliver["t"] - d_add["t"],
           "D deliver -> client has token": t1 - d_deliver["t"], "total (client)": t1 - t0}
    return seg


def profile(work: Path, connector: str, res: dict[str, Any]) -> dict[str, Any]:
    ev: dict[str, list[dict]] = {}
    for who, name in (("C", "C"), ("C_nopc", "C_nopc"), ("E", f"E-{connector}"), ("P", f"P-{connector}"),
                      ("D", f"D-{connector}")):
        ev[who] = sorted(procs.read_trace(work / f"trace-{name}.jsonl") + procs.read_trace(work / f"epd-{name}.jsonl"),
                         key=lambda e: e["t"])
    ev["G"] = procs.read_trace(work / f"epd-G-{connector}.jsonl")
    out: dict[str, Any] = {}
    for key, rs in res["samples"].items():
        mode = key.split("/")[0]
        if mode.startswith(("E_direct", "C_gw")):
            continue
        rows = [seg for r in rs if (seg := _segments(mode, r, ev)) is not None]
        if rows:
            out[key] = {k: median([row[k] for row in rows if k in row]) * 1e3 for k in rows[0]}
            out[key]["# requests traced"] = float(len(rows))
    return out


def print_profile(prof: dict[str, Any], images: list[int]) -> None:
    for group in (("C_new", "C_hit", "C_nopc_new", "C_nopc_hit"), ("epd_new", "epd_hit", "epd_hit_pre")):
        cols = [f"{m}/{k}" for k in images for m in group if f"{m}/{k}" in prof]
        if not cols:
            continue
        procs.print_timeline("time line (ms, medians over reps; server and gateway traces + client stamps)",
                             "segment (# = count)", cols, prof)


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
    ap.add_argument("--profile", action="store_true", help="trace every process and print each mode's time line")
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


def main(argv=None) -> int:
    args = parse_args(argv)
    import httpx

    work = tr.work_dir("epd")
    contention = procs.Contention()
    results: dict[str, Any] = {"args": vars(args), "load_before": procs.loadavg(), "sets": []}
    print(f"bench/epd.py | connectors {args.connectors} | images {args.images} of {args.image_size}x{args.image_size} | "
          f"{args.reps} reps | load {results['load_before']}", flush=True)
    t_start = time.monotonic()
    try:
        from pdserve.modelgen.llava import make_llava_model

        model = make_llava_model(work / "tiny-llava")
        b = Bench(args, work, contention)
        sizes = [len(png_data_url(1, args.image_size))]
        print(f"  tiny LLaVA at {model}; one image data URL is {sizes[0] / 1024:.0f} KiB", flush=True)
        results["pixel_costs"] = pixel_costs(model, args.image_size, args.images)
        results["data_url_KiB"] = sizes[0] / 1024
        print("  per image, in this process (median ms): data URL -> PIL (base64 + PNG decode) "
              f"{results['pixel_costs']['decode_ms']:.2f}, CLIP preprocessing {results['pixel_costs']['preprocess_ms']:.2f}"
              "; JSON parse of the body " + ", ".join(f"{k} img {results['pixel_costs'][f'json_parse_{k}img_ms']:.2f}"
                                                      for k in args.images), flush=True)
        transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        with httpx.Client(timeout=120, transport=transport) as client:
            b.start_shared(model)
            for connector in args.connectors:
                b.start_set(model, connector)
                res = b.run_set(client, connector)
                b.stop_set()
                results["sets"].append(res)
                print_set(res, args)
                if args.profile:
                    res["profile"] = profile(work, connector, res)
                    print_profile(res["profile"], args.images)
    finally:
        tr._cleanup()
    results["load_after"] = procs.loadavg()
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
    procs.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
