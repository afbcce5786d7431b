"""TTFT of push, pull, a client-driven 1P1D and colocated serving, all through real processes, in one run.

Model: the h256 llama preset (hidden 256, 4 layers, 2 KV heads, 32000 vocab), its max_position_embeddings raised
to --max-model-len so 4k prompts fit. Per "set" (one --max-num-batched-tokens value and one data plane; sets run one
after another, each with its own processes and its own colocated baseline): P (kv_producer), D (kv_consumer), C
(colocated), and gateways in front of them. Modes, measured in the same rounds, order rotating:
  C     client -> C directly;              C_gw  client -> `--protocol colocated` gateway -> C;
  pull  client -> pull gateway -> P (prefill, hold) -> D (reads P's blocks) -> first token;
  push  client -> push gateway -> P and D at once; D registers its blocks, P writes each layer as computed;
  pd    client -> P (non-streamed, do_remote_decode) then client -> D (streamed): how vLLM's toy proxy drives it.
TTFT = client sends the streamed request -> first streamed token. Every (round, length, mode) gets its own seeded
random prompt, so there are no prefix hits (pull, push and pd share P and D). The breakdown comes from /metrics
deltas around each request (each instance's own vllm:time_to_first_token, the gateway's leg histograms, D's
kv_transfer_load_seconds) and, where the servers keep one, the request's timeline (D's kv_transfer_start/end).

  .venv/bin/python bench/ttft.py --quick                                    # smoke run (~2 min)
  .venv/bin/python bench/ttft.py --json bench/out/ttft.json                 # push/pull/colocated, mnbt 4096 and 512
  .venv/bin/python bench/ttft.py --modes C,pd --planes shm,tcp --lengths 256,1024,2000 --mnbt 2048 --reps 9 \\
      --json bench/out/pd.json                                              # 1P1D vs colocated per data plane
  .venv/bin/python bench/ttft.py --netns --planes nixl,tcp --modes C,C_gw,pull,push --lengths 2048 --mnbt 4096 \\
      --json bench/out/ttft-netns.json                                      # P, D, C on simulated hosts (root)
"""

from __future__ import annotations

import argparse
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

MODEL_NAME = "h256"
MODES = ("C", "C_gw", "pull", "push", "pd")
# mode -> (ratio bound, prompt length, baseline) for the targets the issues set.
TARGETS = {"push": (1.05, 2048, "C_gw"), "pd": (1.15, 2000, "C")}
TARGETS_NETNS = {"pull": (1.15, 2048, "C_gw"), "push": (1.15, 2048, "C_gw")}  # across simulated hosts
GW_PROTOCOL = {"C_gw": "colocated", "pull": "pull", "push": "push"}


class Set:
    """P, D, C and the gateways the requested modes need, for one (max_num_batched_tokens, data plane) pair; with
    `net` (tests/netns.py) P, D and C each on a simulated host of their own, the gateways on the client's."""

    def __init__(self, args: argparse.Namespace, servers: H.Servers, model: Path, mnbt: int, plane: str,
                 net: Any = None) -> None:
        self.args, self.servers, self.model, self.mnbt, self.plane, self.net = args, servers, model, mnbt, plane, net
        self.label = f"mnbt {mnbt}, plane {plane}{', across namespaces' if net else ''}"

    def _on(self, name: str) -> dict[str, Any]:
        if self.net is None:
            return {}
        return {"host": self.net[name].address, "wrap": self.net[name].wrap(own_pids=name != "client")}

    def start(self) -> None:
        a, sv = self.args, self.servers
        common = ["--max-model-len", str(a.max_model_len), "--num-kv-blocks", str(a.kv_blocks), "--threads",
                  str(a.threads), "--max-num-batched-tokens", str(self.mnbt), "--served-model-name", MODEL_NAME,
                  "--log-level", "warning"]
        for name, role in (("P", "kv_producer"), ("D", "kv_consumer")):
            if set(a.modes) - {"C", "C_gw"}:
                side = {"side_channel_host": self.net[name].address} if self.net else {}
                sv.instance(name, self.model, *common, "--kv-transfer-config", H.kv_config(role, self.plane, **side),
                            **self._on(name))
        sv.instance("C", self.model, *common, **self._on("C"))
        for mode in ("pull", "push"):
            if mode in a.modes:
                sv.gateway(f"G_{mode}", "--prefill", sv.url("P"), "--decode", sv.url("D"), "--protocol", mode,
                           **self._on("client"))
        if "C_gw" in a.modes:
            sv.gateway("G_C_gw", "--both", sv.url("C"), "--protocol", "colocated", **self._on("client"))
        print(f"  [{self.label}] {sv.describe()}", flush=True)

    def body(self, prompt: list[int], stream: bool = True) -> dict[str, Any]:
        # logprobs: every token gets its own chunk (a token without complete text would otherwise wait)
        return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": self.args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream, "logprobs": 0}

    def send(self, client: Any, mode: str, prompt: list[int], meter: H.CpuMeter) -> dict[str, Any]:
        sv = self.servers
        insts = ["C"] if mode in ("C", "C_gw") else ["P", "D"]
        gw = f"G_{mode}" if mode in GW_PROTOCOL else None
        names = insts + ([gw] if gw else [])
        before = {n: H.scrape(client, sv.url(n)) for n in names}
        rid = f"bench-{uuid.uuid4().hex[:16]}"
        meter.mark()
        t0 = time.monotonic()
        if mode == "pd":
            t1, text, p_leg = self._pd(client, prompt, rid)
        else:
            t1, text = H.stream_first(client, sv.url(gw or "C") + "/v1/completions", self.body(prompt),
                                      {"X-Request-Id": rid})
            p_leg = float("nan")
        r: dict[str, Any] = {"ttft": t1 - t0, "p_leg": p_leg, "others": meter.since_mark()["others"],
                             "text": text}
        after = H.settle(client, {n: sv.url(n) for n in names}, before, insts, gw)
        self._breakdown(r, insts, gw, before, after)
        if self.args.timeline and mode not in ("C", "C_gw"):
            ev = H.timeline_events(client, sv.url("D"), rid)
            r["tl_xfer"] = H.first_event(ev, "kv_transfer_end") - H.first_event(ev, "kv_transfer_start")
        return r

    def _pd(self, client: Any, prompt: list[int], rid: str) -> tuple[float, str, float]:
        t0 = time.monotonic()
        body = {**self.body(prompt, stream=False), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        rp = client.post(self.servers.url("P") + "/v1/completions", json=body, headers={"X-Request-Id": rid})
        if rp.status_code != 200:
            raise RuntimeError(f"P: HTTP {rp.status_code}: {rp.text[:500]}")
        body = {**self.body(prompt), "kv_transfer_params": rp.json()["kv_transfer_params"]}
        p_leg = time.monotonic() - t0
        t1, text = H.stream_first(client, self.servers.url("D") + "/v1/completions", body, {"X-Request-Id": rid})
        return t1, text, p_leg

    @staticmethod
    def _breakdown(r: dict, insts: list[str], gw: str | None, before: dict, after: dict) -> None:
        def d(name: str, key: str) -> float:
            return H.delta(after[name], before[name], key)

        srv = "vllm:time_to_first_token_seconds_sum"
        if insts == ["C"]:
            r["srv"] = d("C", srv)
        else:
            r["srv"], r["d_srv"] = d("P", srv), d("D", srv)
            r["d_load"] = d("D", "pdserve:kv_transfer_load_seconds_total")
            r["moved"] = d("D", "pdserve:kv_transfer_bytes_received_total") + d("P", "pdserve:kv_push_bytes_sent_total")
        if gw:
            r.update(H.leg_means(after[gw], before[gw]))


def make_model(work: Path, max_pos: int, preset: str = "h256") -> Path:
    from pdserve.modelgen import make_text_model

    model = Path(make_text_model("llama", work / preset, preset=preset))
    cfg = json.loads((model / "config.json").read_text())
    cfg["max_position_embeddings"] = max_pos
    (model / "config.json").write_text(json.dumps(cfg, indent=2))
    return model


def run_set(s: Set, args: argparse.Namespace, client: Any, meter: H.CpuMeter) -> dict[str, Any]:
    gen = random.Random(1234)

    def prompt(n: int) -> list[int]:
        return [gen.randrange(100, 32000) for _ in range(n)]

    t = time.monotonic()
    agree = {}  # the same prompt through every mode: the same tokens as C
    pr = prompt(min(1024, max(args.lengths)))
    ref = s.send(client, "C", pr, meter)["text"]
    for mode in args.modes:
        agree[mode] = s.send(client, mode, pr, meter)["text"] == ref
    if args.touch_pools:  # cycle every KV pool once (steady state: pages touched, free queue rotated)
        n = min(max(args.lengths), 4096)
        for _ in range(-(-args.kv_blocks * 16 // n) + 1):
            for mode in ["C"] + [m for m in args.modes if m not in ("C", "C_gw")][:1]:
                s.send(client, mode, prompt(n), meter)
    for _ in range(args.warmup):
        for n in args.lengths:
            for mode in args.modes:
                s.send(client, mode, prompt(n), meter)
    print(f"  [{s.label}] answers agree with C: {agree}; pools cycled + warm-up {time.monotonic() - t:.1f} s",
          flush=True)
    samples: dict[str, list[dict[str, Any]]] = {f"{m}/{n}": [] for m in args.modes for n in args.lengths}
    for rep, order in H.rotations(args.modes, args.reps):
        for n in args.lengths:
            if args.wait_idle > 0:
                meter.wait_for_quiet(args.wait_idle)
            for mode in order:
                time.sleep(0.02)
                samples[f"{mode}/{n}"].append({**s.send(client, mode, prompt(n), meter), "rep": rep})
        print(f"  [{s.label}] round {rep + 1}/{args.reps} | load {H.loadavg()}", flush=True)
    return {"mnbt": s.mnbt, "plane": s.plane, "modes": args.modes, "agree": agree, "samples": samples,
            "rows": [{**row(samples, args.modes, n), "netns": s.net is not None} for n in args.lengths]}


def row(samples: dict[str, list[dict[str, Any]]], modes: list[str], n: int) -> dict[str, Any]:
    """Medians per mode at one length (requests during which others used < QUIET_CORES, if at least 3), ratios
    against both colocated baselines, paired ratios (same round), and the denoised ratio: every prefill replaced by
    one pooled median F of all prefilling instances' own TTFT, times the mode's paired prefill slowdown against the
    baseline's, so each mode keeps only its own time outside the prefill (which the box's load swings less)."""
    allr = {m: samples[f"{m}/{n}"] for m in modes}
    quiet = {m: [r for r in v if r["others"] < H.QUIET_CORES] for m, v in allr.items()}
    by = {m: quiet[m] if len(quiet[m]) >= 3 else allr[m] for m in modes}

    def med(m: str, k: str) -> float:
        return H.median([r[k] for r in by[m] if k in r and r[k] == r[k]]) * 1e3

    def pairs(a: str, b: str) -> list[tuple[dict, dict]]:
        rb = {r["rep"]: r for r in allr[b]}
        both = [(r, rb[r["rep"]]) for r in allr[a] if r["rep"] in rb]
        calm = [(x, y) for x, y in both if max(x["others"], y["others"]) < H.QUIET_CORES]
        return calm if len(calm) >= 3 else both

    everything = [r for v in allr.values() for r in v]
    out: dict[str, Any] = {"len": n, "quiet_only": all(len(quiet[m]) >= 3 for m in modes),
                           "others_max": max((r["others"] for r in everything), default=0.0)}
    F = H.median([r["srv"] for m in modes for r in by[m]])
    out["prefill_pooled_ms"] = F * 1e3
    for m in modes:
        for k in ("ttft", "srv", "d_srv", "d_load", "p_leg", "tl_xfer", "gw_prefill", "gw_kv_ready",
                  "gw_decode_first_token"):
            out[f"{m}_{k}_ms"] = med(m, k)
        out[f"{m}_moved_MiB"] = med(m, "moved") / 1e3 / H.MiB
        out[f"{m}_outside_ms"] = H.median([r["ttft"] - r["srv"] for r in by[m]]) * 1e3
    for m in modes:
        for base in ("C_gw", "C"):
            if base not in modes or m == base or (m, base) == ("C", "C_gw"):
                continue
            ps = pairs(m, base)
            slow = H.median([x["srv"] / y["srv"] for x, y in ps])
            out[f"{m}/{base}"] = out[f"{m}_ttft_ms"] / out[f"{base}_ttft_ms"]
            out[f"{m}/{base} paired"] = H.median([x["ttft"] / y["ttft"] for x, y in ps])
            out[f"{m}-{base} ms"] = H.median([x["ttft"] - y["ttft"] for x, y in ps]) * 1e3
            out[f"{m}/{base} denoised"] = ((F * 1e3 * slow + out[f"{m}_outside_ms"])
                                           / (F * 1e3 + out[f"{base}_outside_ms"]))
            out[f"{m}/{base} if no slowdown"] = ((F * 1e3 + out[f"{m}_outside_ms"])
                                                 / (F * 1e3 + out[f"{base}_outside_ms"]))
            out[f"{m} prefill/{base}"] = slow
    return out


def verdict(r: dict[str, Any], m: str) -> str:
    bound, length, base = (TARGETS_NETNS if r.get("netns") else TARGETS).get(m, (None, None, None))
    if bound is None or r["len"] != length or f"{m}/{base}" not in r:
        return ""
    return f"{'PASS' if r[f'{m}/{base}'] <= bound else 'MISS'} (<= {bound} x {base})"


def print_set(res: dict[str, Any]) -> None:
    modes = res["modes"]
    print(f"\n== TTFT, h256 llama, mnbt {res['mnbt']}, data plane {res['plane']} | medians (ms), client send -> "
          "first streamed token; x base (paired; +ms paired difference; denoised; if P's prefill were not slower)")
    for r in res["rows"]:
        for m in modes:
            ratios = "  ".join(
                f"x {b} {r[f'{m}/{b}']:.3f} ({r[f'{m}/{b} paired']:.3f}; {r[f'{m}-{b} ms']:+.1f}; "
                f"{r[f'{m}/{b} denoised']:.3f}; {r[f'{m}/{b} if no slowdown']:.3f})"
                for b in ("C_gw", "C") if f"{m}/{b}" in r)
            print(f"  {r['len']:>5} {m:<5} {r[f'{m}_ttft_ms']:>7.1f}  {ratios}  {verdict(r, m)}")
    print("  breakdown (ms, medians): outside = TTFT minus the prefilling instance's own TTFT (HTTP hops, transfer, "
          "D's step); srv = P's (or C's) vllm:time_to_first_token; P leg = pd's request to P; gw = the gateway's leg "
          "histograms; D load = D's kv_transfer_load_seconds; xfer = D's timeline kv_transfer_start -> end")
    print(f"  {'len':>5} {'mode':<5} {'outside':>7} {'srv':>7} {'D srv':>7} {'P leg':>7} {'gw pre':>7} "
          f"{'gw kv':>7} {'gw D1st':>7} {'D load':>7} {'xfer':>7} {'MiB':>6} {'prefill x':>9}")
    for r in res["rows"]:
        for m in modes:
            g = lambda k, r=r, m=m: H.fmt(r.get(f"{m}_{k}", float("nan")), ".1f")  # noqa: E731
            slow = next((r[f"{m} prefill/{b}"] for b in ("C_gw", "C") if f"{m} prefill/{b}" in r), float("nan"))
            print(f"  {r['len']:>5} {m:<5} {g('outside_ms'):>7} {g('srv_ms'):>7} {g('d_srv_ms'):>7} {g('p_leg_ms'):>7} "
                  f"{g('gw_prefill_ms'):>7} {g('gw_kv_ready_ms'):>7} {g('gw_decode_first_token_ms'):>7} "
                  f"{g('d_load_ms'):>7} {g('tl_xfer_ms'):>7} {g('moved_MiB'):>6} {H.fmt(slow, '.3f'):>9}")
    worst = max(r["others_max"] for r in res["rows"])
    print(f"  answers agree with C: {res['agree']}; others: up to {worst:.2f} cores during a request "
          f"(requests above {H.QUIET_CORES} left out where 3 quiet ones remain)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: lengths 256,2048, 3 rounds, mnbt 2048")
    ap.add_argument("--json", help="write all numbers here")
    ap.add_argument("--modes", default="C,C_gw,pull,push", help=f"comma-separated, of {','.join(MODES)}")
    ap.add_argument("--lengths", default="256,1024,2048,4096")
    ap.add_argument("--mnbt", default="4096,512", help="--max-num-batched-tokens of every instance; one set each")
    ap.add_argument("--planes", default="auto", help="data planes, one set each: auto (= shm here), shm, tcp, nixl")
    ap.add_argument("--netns", action="store_true", help="P, D, C and the client+gateways on simulated hosts "
                    "(network namespaces on a bridge, P, D and C in PID namespaces of their own; needs root)")
    ap.add_argument("--reps", type=int, default=None, help="rounds (default 7; quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up requests per mode and length (default 2)")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every instance")
    ap.add_argument("--kv-blocks", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--no-touch-pools", dest="touch_pools", action="store_false")
    ap.add_argument("--no-timeline", dest="timeline", action="store_false", help="do not read D's request timelines")
    ap.add_argument("--wait-idle", type=float, default=5.0,
                    help="before each (round, length), wait up to S s for other processes to use < 0.25 cores")
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if set(args.modes) - set(MODES) or "C" not in args.modes:
        ap.error(f"--modes: choose from {MODES}; C (the baseline) is required")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.mnbt = [int(x) for x in args.mnbt.split(",")]
    args.planes = [p for p in args.planes.split(",") if p]
    if args.quick:
        args.reps, args.warmup = args.reps or 3, 1 if args.warmup is None else args.warmup
        args.lengths = [256, 2048] if args.lengths == [256, 1024, 2048, 4096] else args.lengths
        args.mnbt = [2048] if args.mnbt == [4096, 512] else args.mnbt
        args.kv_blocks, args.wait_idle, args.touch_pools = min(args.kv_blocks, 512), min(args.wait_idle, 1.0), False
    args.reps, args.warmup = args.reps or 7, 2 if args.warmup is None else args.warmup
    if args.kv_blocks < -(-max(args.lengths) // 16) + 2:
        ap.error(f"--kv-blocks {args.kv_blocks} is less than the longest prompt needs")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cleanup, meter = H.Cleanup(), H.CpuMeter()
    work = cleanup.work_dir("ttft")
    results: dict[str, Any] = {"args": vars(args), "load_before": H.loadavg(), "sets": []}
    print(f"bench/ttft.py | modes {args.modes} | lengths {args.lengths} | mnbt {args.mnbt} | planes {args.planes} | "
          f"{args.reps} rounds | load {results['load_before']}", flush=True)
    t_start = time.monotonic()
    try:
        model = make_model(work, max(args.max_model_len, 2048))
        net = H.simulated_hosts(cleanup, "client", "P", "D", "C") if args.netns else None
        # Across namespaces every request leaves from a thread inside the client's namespace (its sockets live there)
        measure = net["client"].call if net else lambda fn, *a: fn(*a)
        with H.http_client(300) as client:
            for mnbt in args.mnbt:
                for plane in args.planes:
                    servers = H.Servers(cleanup, meter)
                    s = Set(args, servers, model, mnbt, plane, net)
                    s.start()
                    results["sets"].append(measure(run_set, s, args, client, meter))
                    servers.stop()
                    print_set(results["sets"][-1])
    finally:
        cleanup.run()
    targets = TARGETS_NETNS if args.netns else TARGETS
    print("\n== Summary: " + "; ".join(f"{m} <= {b} x {base} at {n} tokens" for m, (b, n, base) in targets.items()
                                       if m in args.modes))
    for res in results["sets"]:
        for r in res["rows"]:
            print(f"  mnbt {res['mnbt']:>4} {res['plane']:<4} {r['len']:>5}: "
                  + ", ".join(f"{m} {r[f'{m}_ttft_ms']:.1f}" for m in res["modes"]) + " ms | "
                  + ", ".join(f"{k} {v:.3f}" for k, v in r.items()
                              if "/" in k.split(" ")[0] and k.count(" ") == k.count(" paired"))
                  + "".join(f" {m}: {verdict(r, m)}" for m in res["modes"] if verdict(r, m)))
    print(f"  load {results['load_before']} -> {H.loadavg()}; wall {time.monotonic() - t_start:.0f} s")
    H.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
