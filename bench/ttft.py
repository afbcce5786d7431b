"""TTFT of push, pull and colocated serving for 256 to 4k-token prompts, all through real processes, in one run.

Issue: "TTFT of push, pull and colocated for 256, 1k, 2k and 4k-token prompts on a model with at least 4 layers;
target push <= 1.05x colocated at 2k tokens (the layer-wise overlap hides the transfer)."

Model: the h256 llama preset (hidden 256, 4 layers, 2 KV heads, 32000 vocab), its config.json rewritten to
max_position_embeddings 8192 (default RoPE) so 4k prompts fit; every instance gets --max-model-len 8192.

Per "set" (one --max-num-batched-tokens value and one data plane; sets run one after another, each with its own
processes and its own colocated baseline):
  * P: kv_producer, D: kv_consumer (PdConnector, data plane auto = shm on one host, or tcp), C: colocated;
  * three gateways: `--protocol pull` and `--protocol push` in front of the same P and D, and
    `--protocol colocated --both C`, so the colocated baseline crosses the same number of HTTP hops.
Modes, measured in the same reps and shuffled each rep:
  C     client -> C directly;             C_gw  client -> colocated gateway -> C;
  pull  client -> pull gateway -> P (prefill, hold) -> D (reads P's blocks) -> first token;
  push  client -> push gateway -> P and D at once; D registers its blocks, P writes each layer as computed.
TTFT = client sends the streamed request -> first streamed token (monotonic clock). Every (rep, length, mode)
gets its own seeded random prompt (no prefix-cache hits anywhere, also not between pull and push, which share P
and D). Before measuring: every KV pool is cycled once, every mode warmed up at every length.
Breakdown from /metrics deltas around each request: the gateway's pdserve:gateway_leg_seconds (prefill, kv_ready,
decode_first_token), each instance's own vllm:time_to_first_token_seconds (engine arrival -> first token, no
HTTP), P's kv_push_writes / kv_push_bytes_sent, D's kv_push_done_ok and kv_transfer_bytes_received.
--profile traces P, D and C (bench/procs.py's hooks, plus push-path stamps defined here: P's per-layer writes,
write-done with its checksums, D's registration and verification; no pdserve code changes) and prints each
mode's request time line. --whatif A,B+C starts, per variant (patches joined by '+'), another patched P/D pair
with its own push gateway, measured as mode "push+A", "push+B+C" in the same reps (see WHATIFS).

  .venv/bin/python bench/ttft.py --quick                         # smoke run (~3 min)
  .venv/bin/python bench/ttft.py --json /tmp/ttft.json           # full: mnbt 4096 and 512, shm
  .venv/bin/python bench/ttft.py --mnbt 2048 --planes auto,tcp --profile
"""

from __future__ import annotations

import argparse
import json
import math
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

MiB = 1 << 20
TARGET = 1.05  # push <= 1.05 x colocated
TARGET_LEN = 2048
QUIET_CORES = 0.3
MODEL_NAME = "h256"
MODES = ("C", "C_gw", "pull", "push")
median = tr.median

WHATIFS = {
    "nochecksum": "P sends write-done without block checksums and D skips verifying them (what the integrity check "
                  "costs on the critical path)",
    "nopoll": "D's engine loop does not sleep after an idle step once a transfer finished (bench/procs.py)",
    "slowpoll": "D's engine loop sleeps 50 ms instead of 5 ms after an idle step (a request waiting for pushed KV); "
                "write-done still wakes it at once",
    "midstep": "P attaches a push registration that arrived during a step at the next layer boundary (catching up "
               "the layers already computed) instead of at the start of the next step",
}


# ============================================================================= tracing of the push path (children)

_SITE = """\
import os, sys
sys.path.insert(0, {bench!r})
import procs as _p
if os.environ.get("PDSERVE_BENCH_TRACE"):
    _p.install_trace(os.environ["PDSERVE_BENCH_TRACE"])
import ttft as _t
_t.install_child_hooks(os.environ.get("PDSERVE_BENCH_PUSH_TRACE"), os.environ.get("PDSERVE_BENCH_WHATIF", ""))
del sys.path[0]
"""


def child_env(work: Path, name: str, trace: bool, whatif: list[str]) -> dict[str, str] | None:
    if not trace and not whatif:
        return None
    site = work / "ttft-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITE.format(bench=str(_BENCH)))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)}
    if trace:
        env["PDSERVE_BENCH_TRACE"] = str(work / f"trace-{name}.jsonl")
        env["PDSERVE_BENCH_PUSH_TRACE"] = str(work / f"push-{name}.jsonl")
    if whatif:
        env["PDSERVE_BENCH_WHATIF"] = ",".join(whatif)
    return env


def install_child_hooks(trace_path: str | None, whatif: str) -> None:
    """In a pdserve child (via sitecustomize): stamp the push path, and/or apply what-if patches."""
    names = [w for w in whatif.split(",") if w]
    if "nopoll" in names:
        procs.install_experiments(["nopoll"])
    if "slowpoll" in names:
        from pdserve.engine import async_engine as ae

        ae._IDLE_POLL_S = 0.05
    if "midstep" in names:
        from pdserve.ids import TransferId
        from pdserve.kv_transfer import push as pu

        orig_save = pu.PushProducer.save_layer

        def save_layer(self, layer: int) -> None:
            for registration in self.agent.take_registrations():
                source = self.sources.get(TransferId(registration.transfer_id))
                if source is None:
                    self._orphans[registration.transfer_id] = (registration, time.monotonic())
                    continue
                self._attach(source, registration)  # whole blocks of earlier chunks (or write-done if finished)
                for chunk in self._step:  # this step's chunk: the layers computed before this one
                    if chunk.transfer_id == source.transfer_id and not source.released:
                        for done in range(layer):
                            self._write(source, chunk.start, chunk.end, done)
            orig_save(self, layer)

        pu.PushProducer.save_layer = save_layer
    if "nochecksum" in names:
        from pdserve.kv_transfer import agent as ag

        ag.block_checksums = lambda kv, ids: []  # write-done (push) and ReadGrantReply (pull) carry no checksums

        def no_verify(kv, block_ids, expected):
            return []

        ag.invalid_blocks = no_verify
    if not trace_path:
        return
    from pdserve.kv_transfer import agent as ag
    from pdserve.kv_transfer import pd_connector as pc
    from pdserve.kv_transfer import push as pu

    tracer = procs._Tracer(trace_path)
    now = time.monotonic

    stamp, stamp_async = procs.stampers(tracer)

    # P (producer)
    stamp(pu.PushProducer, "_run_write", "write",
          lambda self, source, reg, local, remote, layer: {"n": len(local), "layer": -1 if layer is None else layer})
    stamp(pu.PushProducer, "_attach", "attach",
          lambda self, source, reg: {"computed": source.computed, "finished": source.finished})
    stamp(pu.PushProducer, "_write", "submit_write",
          lambda self, source, start, end, layer: {"start": start, "end": end,
                                                   "layer": -1 if layer is None else layer})
    stamp(ag.TransferAgent, "send_write_done", "send_write_done", lambda self, reg, ok, *a, **k: {"ok": ok})
    stamp(pc.PdConnectorWorker, "save_kv_layer", "save_layer", lambda self, layer: {"layer": layer})
    orig_checksums = ag.block_checksums

    def checksums(kv, ids):
        t0 = now()
        out = orig_checksums(kv, ids)
        tracer.ev("checksums", t0, dur=now() - t0, n=len(ids))
        return out
    ag.block_checksums = checksums
    # D (consumer)
    stamp(ag.TransferAgent, "expect_push", "expect_push")
    stamp_async(ag.TransferAgent, "_register_push", "register_push")
    stamp_async(ag.TransferAgent, "_push_done", "push_done")
    stamp(ag.TransferAgent, "_complete_push", "complete_push", lambda self, tid, ok, *a, **k: {"ok": ok})
    orig_invalid = ag.invalid_blocks

    def invalid(kv, block_ids, expected):
        t0 = now()
        out = orig_invalid(kv, block_ids, expected)
        tracer.ev("verify", t0, dur=now() - t0, n=len(block_ids))
        return out
    ag.invalid_blocks = invalid


# ============================================================================= metrics


def scrape(client, url: str) -> dict[str, float]:
    """/metrics as {name or name|label=value: value}, histogram buckets and _created samples dropped."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "le")}
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(labels.items()))
            out[key] = out.get(key, 0.0) + s.value
    return out


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


# ============================================================================= one set of processes


class Set:
    """P, D, C and three gateways for one (max_num_batched_tokens, data plane) pair."""

    def __init__(self, args, work: Path, model: Path, mnbt: int, plane: str, contention: procs.Contention) -> None:
        self.args, self.work, self.model, self.mnbt, self.plane = args, work, model, mnbt, plane
        self.contention = contention
        self.label = f"mnbt {mnbt}, plane {plane}"
        self.procs: dict[str, Any] = {}
        self.variants = {f"+{'+'.join(v)}": v for v in args.whatif}  # suffix -> patches
        self.modes = list(MODES) + [f"push{suffix}" for suffix in self.variants]

    def _start(self, key: str, fn, *a, **k) -> Any:
        proc = fn(*a, **k)
        self.procs[key] = proc
        tr._CLEANUP.append(proc.stop)
        self.contention.pids.append(proc.pid)
        return proc

    def start(self) -> None:
        from pdserve.launcher import start, start_instance

        a = self.args
        common = ["--max-model-len", str(a.max_model_len), "--num-kv-blocks", str(a.kv_blocks), "--threads",
                  str(a.threads), "--max-num-batched-tokens", str(self.mnbt), "--served-model-name", MODEL_NAME,
                  "--log-level", "warning"]

        def kv(role: str) -> str:
            cfg: dict[str, Any] = {"kv_connector": "PdConnector", "kv_role": role}
            if self.plane != "auto":
                cfg["kv_connector_extra_config"] = {"data_plane": self.plane}
            return json.dumps(cfg)

        tag = f"{self.mnbt}-{self.plane}"
        pairs = [("", [])] + list(self.variants.items())
        for suffix, whatif in pairs:
            for name, role in (("P", "kv_producer"), ("D", "kv_consumer")):
                env = child_env(self.work, f"{name}{suffix}-{tag}", a.profile, whatif)
                self._start(name + suffix, start_instance, self.model, *common, "--kv-transfer-config", kv(role),
                            name=f"{name}{suffix}-{tag}", env=env, timeout=180)
        self._start("C", start_instance, self.model, *common, name=f"C-{tag}",
                    env=child_env(self.work, f"C-{tag}", a.profile, []), timeout=180)
        gw = ["--port", "0", "--log-level", "warning"]
        P, D, C = self.procs["P"].url, self.procs["D"].url, self.procs["C"].url
        self._start("G_pull", start, f"G_pull-{tag}", ["gateway", "--prefill", P, "--decode", D, "--protocol", "pull",
                                                       *gw])
        self._start("G_push", start, f"G_push-{tag}", ["gateway", "--prefill", P, "--decode", D, "--protocol", "push",
                                                       *gw])
        self._start("G_C", start, f"G_C-{tag}", ["gateway", "--both", C, "--protocol", "colocated", *gw])
        for suffix in self.variants:
            self._start(f"G_push{suffix}", start, f"G_push{suffix}-{tag}", [
                "gateway", "--prefill", self.procs[f"P{suffix}"].url, "--decode", self.procs[f"D{suffix}"].url,
                "--protocol", "push", *gw])
        print(f"  [{self.label}] " + ", ".join(f"{n} pid {p.pid}" for n, p in self.procs.items()), flush=True)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()

    def route(self, mode: str) -> tuple[str, str | None, list[str]]:
        """(URL the client sends to, gateway name or None, instances whose metrics matter)."""
        if mode == "C":
            return self.procs["C"].url, None, ["C"]
        if mode == "C_gw":
            return self.procs["G_C"].url, "G_C", ["C"]
        if mode.startswith("push+"):
            suffix = mode[4:]
            return self.procs[f"G_push{suffix}"].url, f"G_push{suffix}", [f"P{suffix}", f"D{suffix}"]
        return self.procs[f"G_{mode}"].url, f"G_{mode}", ["P", "D"]

    def send(self, client, mode: str, prompt: list[int]) -> dict[str, Any]:
        url, gw, insts = self.route(mode)
        names = insts + ([gw] if gw else [])
        before = {n: scrape(client, self.procs[n].url) for n in names}
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": self.args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True,
                "logprobs": 0}  # every token gets a chunk (a token without complete text would otherwise wait)
        self.contention.mark()
        t0 = time.monotonic()
        t1, first = tr.stream_first(client, url, body)
        t_end = time.monotonic()
        others = self.contention.since_mark()["others"]
        # Let everything settle (P frees after write-done / read-done; the gateway observes after the stream).
        deadline = time.monotonic() + 5
        while True:
            after = {n: scrape(client, self.procs[n].url) for n in names}
            settled = all(after[n].get("pdserve:num_requests_held", 0) == 0
                          and after[n].get("pdserve:kv_leases_held", 0) == 0
                          and after[n].get("pdserve:kv_push_expected", 0) == 0 for n in insts)
            if gw:
                settled = settled and delta(after[gw], before[gw], "pdserve:gateway_requests_total|outcome=ok"
                                            f"|protocol={self.gw_protocol(mode)}") >= 1
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        r: dict[str, Any] = {"ttft": t1 - t0, "stream": t_end - t0, "others": others, "t0": t0, "t1": t1,
                             "text": first["choices"][0].get("text")}
        srv = "vllm:time_to_first_token_seconds_sum"
        if mode in ("C", "C_gw"):
            r["c_srv"] = delta(after["C"], before["C"], srv)
        else:
            p, d = insts
            r["p_srv"] = delta(after[p], before[p], srv)
            r["d_srv"] = delta(after[d], before[d], srv)
            r["d_bytes_pulled"] = delta(after[d], before[d], "pdserve:kv_transfer_bytes_received_total")
            r["d_load_s"] = delta(after[d], before[d], "pdserve:kv_transfer_load_seconds_total")
            r["d_push_done_ok"] = delta(after[d], before[d], "pdserve:kv_push_done_ok_total")
            r["d_push_done_failed"] = delta(after[d], before[d], "pdserve:kv_push_done_failed_total")
            r["p_push_writes"] = delta(after[p], before[p], "pdserve:kv_push_writes_total")
            r["p_push_bytes"] = delta(after[p], before[p], "pdserve:kv_push_bytes_sent_total")
            r["d_prompt_computed"] = delta(after[d], before[d], "pdserve:prompt_tokens_computed_total")
        if gw:
            for leg in ("prefill", "kv_ready", "decode_first_token", "e2e"):
                n = delta(after[gw], before[gw], f"pdserve:gateway_leg_seconds_count|leg={leg}")
                if n:
                    r[f"gw_{leg}"] = delta(after[gw], before[gw], f"pdserve:gateway_leg_seconds_sum|leg={leg}") / n
        return r

    @staticmethod
    def gw_protocol(mode: str) -> str:
        return {"C_gw": "colocated", "pull": "pull"}.get(mode, "push")


# ============================================================================= the measurement


def make_model(work: Path, max_pos: int) -> Path:
    from pdserve.modelgen import make_text_model

    model = Path(make_text_model("llama", work / "h256", preset="h256"))
    cfg_path = model / "config.json"
    cfg = json.loads(cfg_path.read_text())
    old = cfg.get("max_position_embeddings")
    cfg["max_position_embeddings"] = max_pos
    cfg_path.write_text(json.dumps(cfg, indent=2))
    print(f"  model {model}: h256 llama, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"{cfg.get('num_key_value_heads')} KV heads, vocab {cfg['vocab_size']}; max_position_embeddings "
          f"{old} -> {max_pos} (rope_scaling {cfg.get('rope_scaling')})", flush=True)
    return model


def run_set(s: Set, args, client, gen: random.Random) -> dict[str, Any]:
    def prompt(n: int) -> list[int]:
        return [gen.randrange(100, 32000) for _ in range(n)]

    t = time.monotonic()
    # Correctness: the same prompt through push and C (direct), another through pull and C_gw: first tokens agree.
    agree = []
    for a_mode, b_mode in [("push", "C"), ("pull", "C_gw")] + [(m, "C") for m in s.modes if m.startswith("push+")]:
        pr = prompt(min(1024, max(args.lengths)))
        agree.append((a_mode, b_mode, s.send(client, a_mode, pr)["text"] == s.send(client, b_mode, pr)["text"]))
    if args.touch_pools:  # cycle every KV pool once (steady state: pages touched, free queue rotated)
        n = min(max(args.lengths), 4096)
        for _ in range(-(-args.kv_blocks * 16 // n) + 1):
            for mode in ["C", "pull"] + [m for m in s.modes if m.startswith("push+")]:
                s.send(client, mode, prompt(n))
    for _ in range(args.warmup):
        for n in args.lengths:
            for mode in s.modes:
                s.send(client, mode, prompt(n))
    print(f"  [{s.label}] first-token agreement {agree}; pools cycled + warm-up {time.monotonic() - t:.1f} s",
          flush=True)
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {(m, n): [] for m in s.modes for n in args.lengths}
    rng = random.Random(7)
    reps_info = []
    for rep in range(args.reps):
        lengths = list(args.lengths)
        rng.shuffle(lengths)
        for n in lengths:
            waited = s.contention.wait_for_quiet(args.wait_idle) if args.wait_idle > 0 else 0.0
            order = list(s.modes)
            rng.shuffle(order)
            for mode in order:
                time.sleep(0.02)
                r = s.send(client, mode, prompt(n))
                r["rep"] = rep
                samples[(mode, n)].append(r)
            reps_info.append({"rep": rep, "len": n, "waited_s": waited, "order": order})
        print(f"  [{s.label}] rep {rep + 1}/{args.reps} | load {procs.loadavg()}", flush=True)
    return summarize(s, args, samples, reps_info, agree)


def summarize(s: Set, args, samples, reps_info, agree) -> dict[str, Any]:
    res: dict[str, Any] = {"mnbt": s.mnbt, "plane": s.plane, "modes": s.modes, "agree": agree, "rows": [],
                           "reps_info": reps_info,
                           "samples": {f"{m}/{n}": v for (m, n), v in samples.items()}}
    return summarize_samples(res, args.lengths)


def summarize_samples(res: dict[str, Any], lengths: list[int]) -> dict[str, Any]:
    """Rows (one per prompt length) from res["samples"]; also used by --from-json."""

    class _S:
        modes = res["modes"]
    s = _S
    samples = {(k.split("/")[0], int(k.split("/")[1])): v for k, v in res["samples"].items()}
    res["rows"] = []
    for n in lengths:
        # Per mode, keep the requests during which other processes used < QUIET_CORES (if at least 3 of them;
        # else all); paired statistics use the reps in which both requests were quiet (same fallback).
        allr = {m: samples[(m, n)] for m in s.modes}
        quiet = {m: [r for r in v if r["others"] < QUIET_CORES] for m, v in allr.items()}
        by = {m: (quiet[m] if len(quiet[m]) >= 3 else allr[m]) for m in s.modes}
        def med(m: str, k: str, by=by) -> float:
            return median([r[k] for r in by[m] if k in r])

        def pairs(a: str, b: str, allr=allr) -> list[tuple[dict, dict]]:
            rb = {r["rep"]: r for r in allr[b]}
            both = [(r, rb[r["rep"]]) for r in allr[a] if r["rep"] in rb]
            calm = [(x, y) for x, y in both if x["others"] < QUIET_CORES and y["others"] < QUIET_CORES]
            return calm if len(calm) >= 3 else both

        def paired(a: str, b: str) -> float:
            return median([x["ttft"] / y["ttft"] for x, y in pairs(a, b)])

        def paired_diff(a: str, b: str) -> float:
            return median([x["ttft"] - y["ttft"] for x, y in pairs(a, b)])

        everything = [r for v in allr.values() for r in v]
        row: dict[str, Any] = {"len": n, "requests": len(everything),
                               "quiet_requests": sum(len(v) for v in quiet.values()),
                               "kept": {m: len(by[m]) for m in s.modes},
                               "quiet_only": all(len(quiet[m]) >= 3 for m in s.modes),
                               "others_max": max((r["others"] for r in everything), default=0.0),
                               "others_median": median([r["others"] for r in everything])}
        for m in s.modes:
            row[f"{m}_ms"] = med(m, "ttft") * 1e3
            row[f"{m}_all_ms"] = [round(r["ttft"] * 1e3, 2) for r in by[m]]
        for m in s.modes:  # time outside the prefill: client TTFT minus the prefilling instance's own TTFT
            srv = "c_srv" if m in ("C", "C_gw") else "p_srv"
            row[f"{m}_outside_ms"] = median([r["ttft"] - r[srv] for r in by[m]]) * 1e3
        # Denoised: the prefill swings with other processes' load, so replace it by one pooled figure F (median of
        # every prefilling instance's own TTFT, quiet requests preferred) times this mode's paired prefill slowdown
        # against C_gw's (P's prefill may really be slower under push), and keep each mode's own time outside it.
        pool = [r["c_srv" if m in ("C", "C_gw") else "p_srv"] for m in s.modes for r in by[m]]
        F = median(pool)
        row["prefill_pooled_ms"] = F * 1e3
        for m in s.modes:
            srv = "c_srv" if m in ("C", "C_gw") else "p_srv"
            slow = 1.0 if m == "C_gw" else median([x[srv] / y["c_srv"] for x, y in pairs(m, "C_gw")])
            row[f"{m}_prefill_vs_C_gw"] = slow
            row[f"{m}_denoised_ms"] = (F * slow + row[f"{m}_outside_ms"] / 1e3) * 1e3
        for m in s.modes:
            for base in ("C_gw", "C"):
                row[f"{m}_denoised_over_{base}"] = 1.0
                row[f"{m}_denoised_noslow_over_{base}"] = 1.0
                if m != base:
                    row[f"{m}_denoised_over_{base}"] = row[f"{m}_denoised_ms"] / row[f"{base}_denoised_ms"]
                    row[f"{m}_denoised_noslow_over_{base}"] = ((F * 1e3 + row[f"{m}_outside_ms"])
                                                               / (F * 1e3 + row[f"{base}_outside_ms"]))
        for m in s.modes:
            if m in ("C", "C_gw"):
                row[f"{m}_srv_ms"] = med(m, "c_srv") * 1e3
                continue
            for k in ("p_srv", "d_srv", "d_load_s"):
                row[f"{m}_{k}_ms"] = med(m, k) * 1e3
            for k in ("d_bytes_pulled", "p_push_bytes"):
                row[f"{m}_{k}_MiB"] = med(m, k) / MiB
            for k in ("p_push_writes", "d_push_done_ok", "d_push_done_failed", "d_prompt_computed"):
                row[f"{m}_{k}"] = med(m, k)
        for m in s.modes:
            if m == "C":
                continue
            for leg in ("prefill", "kv_ready", "decode_first_token"):
                v = med(m, f"gw_{leg}")
                if not math.isnan(v):
                    row[f"{m}_gw_{leg}_ms"] = v * 1e3
        for m in [x for x in s.modes if x not in ("C", "C_gw")] + ["C_gw"]:
            for base in ("C_gw", "C"):
                if m == base:
                    continue
                row[f"{m}_over_{base}"] = row[f"{m}_ms"] / row[f"{base}_ms"]
                row[f"{m}_over_{base}_paired"] = paired(m, base)
                row[f"{m}_minus_{base}_ms"] = paired_diff(m, base) * 1e3
        res["rows"].append(row)
    return res


# ============================================================================= printing


def fmt(v: Any, spec: str = ".1f") -> str:
    return tr.fmt(v, spec) if isinstance(v, float) else str(v)


def verdict(ratio: float) -> str:
    return "PASS" if ratio <= TARGET else "MISS"


def print_set(res: dict[str, Any]) -> None:
    modes = res["modes"]
    print(f"\n== TTFT, h256 llama (4 layers), mnbt {res['mnbt']}, data plane {res['plane']} | medians (ms) of the "
          "kept reps; client send -> first streamed token")
    w = max(8, max(len(m) for m in modes) + 1)
    print(f"  {'len':>5} {'mode':<{w}} {'TTFT':>7} {'x C_gw':>7} {'paired':>7} {'+ms':>7} {'x C':>7} {'paired':>7} "
          f"{'+ms':>7}  {'target':<9} {'quiet':>8} {'others':>10}")
    for r in res["rows"]:
        for m in modes:
            cols = f"  {r['len']:>5} {m:<{w}} {r[f'{m}_ms']:>7.1f}"
            for base in ("C_gw", "C"):
                if m == base or (m == "C" and base == "C_gw"):
                    cols += f" {'':>7} {'':>7} {'':>7}"
                    continue
                cols += (f" {r[f'{m}_over_{base}']:>7.3f} {r[f'{m}_over_{base}_paired']:>7.3f} "
                         f"{r[f'{m}_minus_{base}_ms']:>+7.1f}")
            tag = ""
            if r["len"] == TARGET_LEN and m.startswith("push"):
                tag = f"{verdict(r[f'{m}_over_C_gw'])}/{verdict(r[f'{m}_over_C'])}"
            extra = (f" {r['quiet_requests']:>3}/{r['requests']:<3}{'q' if r['quiet_only'] else '!'} "
                     f"{r['others_median']:.2f}/{r['others_max']:.2f}") if m == "C" else ""
            print(cols + f"  {tag:<9}" + extra)
    print("  x C_gw / x C: ratio of medians against colocated through its gateway / directly; paired: median of the "
          "same rep's ratios; +ms: median of the same rep's differences. target: PASS/MISS vs C_gw / vs C")
    print("  denoised (prefill replaced by the pooled median F of every prefilling instance's own TTFT, times the mode's "
          "paired prefill slowdown vs C_gw; each mode keeps its own time outside the prefill):")
    print(f"  {'len':>5} {'F':>7}  {'mode':<{w}} {'prefill':>8} {'outside':>8} {'TTFT~':>8} {'x C_gw':>7} {'x C':>7} "
          f"{'x C_gw if no slowdown':>22}  target")
    for r in res["rows"]:
        for m in modes:
            if m == "C":
                continue
            tag = ""
            if r["len"] == TARGET_LEN and m.startswith("push"):
                tag = f"{verdict(r[f'{m}_denoised_over_C_gw'])}/{verdict(r[f'{m}_denoised_over_C'])}"
            print(f"  {r['len']:>5} {r['prefill_pooled_ms']:>7.1f}  {m:<{w}} {r[f'{m}_prefill_vs_C_gw']:>7.3f}x "
                  f"{r[f'{m}_outside_ms']:>8.1f} {r[f'{m}_denoised_ms']:>8.1f} {r[f'{m}_denoised_over_C_gw']:>7.3f} "
                  f"{r[f'{m}_denoised_over_C']:>7.3f} {r.get(f'{m}_denoised_noslow_over_C_gw', 1.0):>22.3f}  {tag}")
    print("  breakdown (ms, medians): outside = client TTFT minus the prefilling instance's own TTFT (P's for pull/push, "
          "C's for C/C_gw): HTTP hops, transfer, D's step; srv = the instance's own vllm:time_to_first_token (arrival "
          "-> first token); gw = the gateway's leg histograms; pulled/pushed MiB")
    print(f"  {'len':>5} {'mode':<{w}} {'outside':>7} {'P srv':>7} {'D srv':>7} {'C srv':>7} {'gw prefill':>10} {'gw kv_ready':>11} "
          f"{'gw D 1st':>8} {'D load':>7} {'pulled':>7} {'pushed':>7} {'writes':>6} {'done_ok':>7} {'D computed':>10}")
    for r in res["rows"]:
        for m in modes:
            def g(k: str, r=r, m=m) -> float:
                return r.get(f"{m}_{k}", float("nan"))
            c_srv = r.get(f"{m}_srv_ms", float("nan"))
            print(f"  {r['len']:>5} {m:<{w}} {fmt(g('outside_ms')):>7} {fmt(g('p_srv_ms')):>7} {fmt(g('d_srv_ms')):>7} {fmt(c_srv):>7} "
                  f"{fmt(g('gw_prefill_ms')):>10} {fmt(g('gw_kv_ready_ms')):>11} {fmt(g('gw_decode_first_token_ms')):>8} "
                  f"{fmt(g('d_load_s_ms'), '.2f'):>7} {fmt(g('d_bytes_pulled_MiB'), '.2f'):>7} "
                  f"{fmt(g('p_push_bytes_MiB'), '.2f'):>7} {fmt(g('p_push_writes'), '.0f'):>6} "
                  f"{fmt(g('d_push_done_ok'), '.0f'):>7} {fmt(g('d_prompt_computed'), '.0f'):>10}")
    print(f"  target: push <= {TARGET} x colocated at {TARGET_LEN} tokens (PASS/MISS on the ratio of medians). "
          f"quiet: requests during which other processes used < {QUIET_CORES} cores / all requests at this length; "
          "medians use only those (per mode, if >= 3, else all: '!'); others = cores used by other processes during "
          "a request, median/max")
    print(f"  first tokens agree (same prompt, different paths): {res['agree']}")


# ============================================================================= profile (server traces)


def _first(evs, name, after=float("-inf"), pred=lambda e: True):
    return next((e for e in evs if e["ev"] == name and e["t"] >= after and pred(e)), None)


def _end(e) -> float:
    return e["t"] + e.get("dur", 0.0)


def segments(mode: str, r: dict, ev: dict[str, list[dict]]) -> dict[str, float] | None:
    t0, t1 = r["t0"], r["t1"]
    win = {k: [e for e in v if t0 <= e["t"] <= t1 + 0.002] for k, v in ev.items()}
    if mode in ("C", "C_gw"):
        c = win.get("C", [])
        add, step = _first(c, "add"), _first(c, "step")
        if not add or not step:
            return None
        deliver = _first(c, "deliver", step["t"])
        if not deliver:
            return None
        steps = [e for e in c if e["ev"] == "step" and e["t"] <= deliver["t"]]  # the prefill's steps
        return {"client -> C engine add": add["t"] - t0, "C add -> first step": step["t"] - add["t"],
                "C prefill (first step start -> output delivered)": deliver["t"] - step["t"],
                "C prefill steps, sum of step times": sum(e["dur"] for e in steps),
                "# C steps": float(len(steps)), "C deliver -> client has token": t1 - deliver["t"],
                "total (client)": t1 - t0}
    P, D = ("P" + mode[4:], "D" + mode[4:]) if mode.startswith("push+") else ("P", "D")
    p, d = win.get(P, []), win.get(D, [])
    pp, dp = win.get(P + "+push", []), win.get(D + "+push", [])
    p_add, d_add = _first(p, "add"), _first(d, "add")
    if not p_add or not d_add:
        return None
    p_deliver = _first(p, "deliver", p_add["t"])
    p_steps = [e for e in p if e["ev"] == "step" and (p_deliver is None or e["t"] <= p_deliver["t"])]
    if not p_steps:
        return None
    seg: dict[str, float] = {"client -> P engine add": p_add["t"] - t0, "client -> D engine add": d_add["t"] - t0,
                             "P add -> first prefill step": p_steps[0]["t"] - p_add["t"],
                             "P prefill steps (first start -> last end)": _end(p_steps[-1]) - p_steps[0]["t"],
                             "P prefill steps, sum of step times": sum(e["dur"] for e in p_steps),
                             "# P steps": float(len(p_steps))}
    p_end = _end(p_steps[-1])
    d_steps = [e for e in d if e["ev"] == "step"]
    if mode == "pull":
        p_fin = _first(p, "deliver", p_steps[-1]["t"], lambda e: e.get("fin"))
        read, finish = _first(d, "read_blocks"), _first(d, "finish_load")
        if not p_fin or not read or not finish:
            return None
        grant = _first(d, "request", pred=lambda e: e.get("msg") == "ReadGrant")
        d_step = next((e for e in d_steps if e["t"] >= finish["t"]), None)
        if not d_step:
            return None
        d_deliver = _first(d, "deliver", d_step["t"])
        seg.update({
            "P prefill (first step start -> output delivered)": p_fin["t"] - p_steps[0]["t"],
            "P deliver -> D engine add (P->G->D HTTP)": d_add["t"] - p_fin["t"],
            "D add -> ReadGrant sent": (grant["t"] if grant else read["t"]) - d_add["t"],
            "D ReadGrant round trip (P checksums)": grant["dur"] if grant else float("nan"),
            "D read_blocks": read["dur"], "D read end -> finish_load": finish["t"] - _end(read),
            "D finish_load -> 1-token step": d_step["t"] - finish["t"],
            "D 1-token step start -> output delivered": (d_deliver["t"] - d_step["t"]) if d_deliver else float("nan"),
            "D deliver -> client has token": (t1 - d_deliver["t"]) if d_deliver else float("nan"),
        })
    else:
        writes = [e for e in pp if e["ev"] == "write"]
        layers = [e for e in pp if e["ev"] == "save_layer"]
        wdone = _first(pp, "send_write_done")
        cks = _first(pp, "checksums")
        attach = _first(pp, "attach")
        reg = _first(dp, "register_push")
        pdone, verify = _first(dp, "push_done"), _first(dp, "verify")
        complete = _first(dp, "complete_push")
        if not writes or not wdone or not complete:
            return None
        d_step = next((e for e in d_steps if e["t"] >= complete["t"]), None)
        if not d_step:
            return None
        d_deliver = _first(d, "deliver", d_step["t"])
        last_write = max(writes, key=_end)
        seg.update({
            "D add -> registration sent+acked (round trip)": (_end(reg) - d_add["t"]) if reg else float("nan"),
            "P attach (registration) - P first step start": (attach["t"] - p_steps[0]["t"]) if attach else float("nan"),
            "# catch-up writes (whole blocks, before attach)": float(sum(1 for e in writes if e.get("layer") == -1)),
            "# layer writes": float(sum(1 for e in writes if e.get("layer", -1) >= 0)),
            "P writes, sum of write times (writer thread)": sum(e["dur"] for e in writes),
            "P last layer computed -> its write end": (_end(last_write) - layers[-1]["t"]) if layers else float("nan"),
            "P last step end -> last write end": _end(last_write) - p_end,
            "P last write end -> write-done start": wdone["t"] - _end(last_write),
            "P send_write_done (checksums + send)": wdone["dur"],
            "P   of which checksums": cks["dur"] if cks else float("nan"),
            "D push_done handler (verify + complete)": pdone["dur"] if pdone else float("nan"),
            "D   of which verify checksums": verify["dur"] if verify else float("nan"),
            "write-done start -> D complete_push": complete["t"] - wdone["t"],
            "D complete_push -> 1-token step start": d_step["t"] - complete["t"],
            "D 1-token step start -> output delivered": (d_deliver["t"] - d_step["t"]) if d_deliver else float("nan"),
            "D deliver -> client has token": (t1 - d_deliver["t"]) if d_deliver else float("nan"),
            "# D idle steps while waiting": float(sum(1 for e in d if e["ev"] == "idle_step")),
            "D idle steps, sum of their time": sum(e["dur"] for e in d if e["ev"] == "idle_step"),
        })
    seg["total (client)"] = t1 - t0
    return seg


def profile(s: Set, res: dict[str, Any], work: Path) -> dict[str, Any]:
    tag = f"{s.mnbt}-{s.plane}"
    ev = {}
    for name in ["P", "D", "C"] + [x + suffix for suffix in s.variants for x in ("P", "D")]:
        ev[name] = procs.read_trace(work / f"trace-{name}-{tag}.jsonl")
        ev[name + "+push"] = procs.read_trace(work / f"push-{name}-{tag}.jsonl")
    out: dict[str, Any] = {}
    for key, rs in res["samples"].items():
        mode = key.split("/")[0]
        rows = [seg for r in rs if (seg := segments(mode, r, ev)) is not None]
        if rows:
            keys = list(dict.fromkeys(k for row in rows for k in row))
            out[key] = {k: median([row[k] for row in rows if k in row and row[k] == row[k]])
                        * (1 if k.startswith("#") else 1e3) for k in keys}
            out[key]["#requests traced"] = float(len(rows))
    return out


def print_profile(prof: dict[str, Any], lengths: list[int], modes: list[str]) -> None:
    for group in (("C", "C_gw"), ("pull",), ("push",)):
        cols = [f"{m}/{n}" for n in lengths for m in modes if (m in group or m.startswith("push+") and group == ("push",))
                and f"{m}/{n}" in prof]
        if not cols:
            continue
        procs.print_timeline(f"time line of {'/'.join(group)} requests (ms, medians over reps; server traces + client "
                             "stamps)", "segment (# = count)", cols, prof)


# ============================================================================= main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: lengths 256,2048, 3 reps, mnbt 2048")
    ap.add_argument("--json", help="write all numbers here")
    ap.add_argument("--lengths", default="256,1024,2048,4096")
    ap.add_argument("--mnbt", default="4096,512", help="--max-num-batched-tokens of every instance; one set each")
    ap.add_argument("--planes", default="auto", help="data planes, one set each: auto (= shm here), shm, tcp")
    ap.add_argument("--reps", type=int, default=None, help="reps per mode and length (default 7; quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up requests per mode and length (default 2)")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every instance")
    ap.add_argument("--kv-blocks", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--no-touch-pools", dest="touch_pools", action="store_false")
    ap.add_argument("--wait-idle", type=float, default=5.0,
                    help="before each (rep, length), wait up to S s for other processes to use < 0.25 cores")
    ap.add_argument("--profile", action="store_true", help="trace P, D, C and print each mode's time line")
    ap.add_argument("--from-json", help="print the tables of an earlier --json run again (recomputing the summary)")
    ap.add_argument("--whatif", default="", help="comma-separated variants, each one or more patches joined by '+'; "
                    "each variant gets its own patched P/D pair and push gateway (mode push+VARIANT): "
                    + "; ".join(f"{k}: {v}" for k, v in WHATIFS.items()))
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.mnbt = [int(x) for x in args.mnbt.split(",")]
    args.planes = [p for p in args.planes.split(",") if p]
    args.whatif = [[p for p in v.split("+") if p] for v in args.whatif.split(",") if v]
    unknown = {p for v in args.whatif for p in v} - set(WHATIFS)
    if unknown:
        ap.error(f"unknown --whatif {sorted(unknown)}; known: {sorted(WHATIFS)}")
    if args.quick:
        args.reps = args.reps or 3
        args.warmup = 1 if args.warmup is None else args.warmup
        if args.lengths == [256, 1024, 2048, 4096]:
            args.lengths = [256, 2048]
        if args.mnbt == [4096, 512]:
            args.mnbt = [2048]
        args.kv_blocks = min(args.kv_blocks, 512)
        args.wait_idle = min(args.wait_idle, 1.0)
    args.reps = args.reps or 7
    args.warmup = 2 if args.warmup is None else args.warmup
    need = -(-max(args.lengths) // 16) + 2
    if args.kv_blocks < need:
        ap.error(f"--kv-blocks {args.kv_blocks} is less than the longest prompt needs ({need})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        old = json.loads(Path(args.from_json).read_text())
        for res in old["sets"]:
            summarize_samples(res, old["args"]["lengths"])
            print_set(res)
            if res.get("profile"):
                print_profile(res["profile"], old["args"]["lengths"], res["modes"])
        print(f"  load {old.get('load_before')} -> {old.get('load_after')}; wall {old.get('wall_s', 0):.0f} s")
        return 0
    import httpx

    work = tr.work_dir("ttft")
    contention = procs.Contention()
    results: dict[str, Any] = {"args": vars(args), "load_before": procs.loadavg(), "sets": []}
    print(f"bench/ttft.py | lengths {args.lengths} | mnbt {args.mnbt} | planes {args.planes} | {args.reps} reps | "
          f"instance threads {args.threads} | load {results['load_before']}", flush=True)
    t_start = time.monotonic()
    try:
        model = make_model(work, max(args.max_model_len, 2048))
        gen = random.Random(1234)
        transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        with httpx.Client(timeout=300, transport=transport) as client:
            for mnbt in args.mnbt:
                for plane in args.planes:
                    s = Set(args, work, model, mnbt, plane, contention)
                    s.start()
                    res = run_set(s, args, client, gen)
                    s.stop()
                    results["sets"].append(res)
                    print_set(res)
                    if args.profile:
                        res["profile"] = profile(s, res, work)
                        print_profile(res["profile"], args.lengths, res["modes"])
    finally:
        tr._cleanup()
    results["load_after"] = procs.loadavg()
    results["wall_s"] = time.monotonic() - t_start
    print(f"\n== Summary (target push <= {TARGET} x colocated at {TARGET_LEN} tokens)")
    for res in results["sets"]:
        for r in res["rows"]:
            pd = [m for m in res["modes"] if m not in ("C", "C_gw")]
            print(f"  mnbt {res['mnbt']:>4} {res['plane']:<4} {r['len']:>5}: C {r['C_ms']:.1f}, C_gw {r['C_gw_ms']:.1f}, "
                  + ", ".join(f"{m} {r[f'{m}_ms']:.1f}" for m in pd) + " ms | "
                  + ", ".join(f"{m}/C_gw {r[f'{m}_over_C_gw']:.3f} (paired {r[f'{m}_over_C_gw_paired']:.3f})"
                              f"{' ' + verdict(r[f'{m}_over_C_gw']) if r['len'] == TARGET_LEN and m.startswith('push') else ''}"
                              for m in pd)
                  + " | " + ", ".join(f"{m}/C {r[f'{m}_over_C']:.3f}" for m in pd))
    print(f"  load {results['load_before']} -> {results['load_after']}; wall {results['wall_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        print(f"  wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
