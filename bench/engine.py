"""pdserve vs Hugging Face `generate`, side by side in one process, against the roofline measured in the same run.

Workloads (as in ../shared/docs/reference/engine-anchor.md, section 1):
  * offline: 64 prompts x 128 random token ids (numpy.random.default_rng(0), ids in [0, 4096)) -> 128 new tokens,
    greedy, ignore_eos. HF: one `generate` call at batch 64 (equal lengths, so no padding). pdserve: `LLM.generate`
    with prefix caching off, once per max_num_batched_tokens value in --mnbt. Output tok/s = 64 * 128 / wall.
  * latency: one request, 512-token prompt, 64 new tokens. TTFT = request start -> first token; TPOT = (last token
    time - first token time) / 63. HF timestamps every step with a BaseStreamer; pdserve is stepped by hand.
Both engines run in this process with the same torch thread count, are warmed up first, and their repetitions are
interleaved (the order alternates every rep) so that background load hits both alike. Ratios are of medians.

`--profile` instead breaks a pdserve decode step down (batch 64 and batch 1): engine phases and model parts timed
with perf_counter wrappers, then torch.profiler's top ops.

  .venv/bin/python bench/engine.py --quick                      # smoke run, about a minute
  .venv/bin/python bench/engine.py                              # tiny + llama120m, fp32 + bf16, about 10 minutes
  .venv/bin/python bench/engine.py --model-preset llama120m --dtype float32 --out docs/benchmarks-engine.json
  .venv/bin/python bench/engine.py --profile --model-preset llama120m
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRESETS = ("tiny", "h256", "llama120m")
# Set on llama-120m by the anchor measurements (engine-anchor.md): pdserve / HF.
TARGET_THROUGHPUT = {"float32": 1.7, "bfloat16": 2.4}
TARGET_TPOT = {"float32": 0.65}
TARGET_PRESET = "llama120m"
# A repetition during which other processes used more cores than this is redone (see --retries).
BUSY_CORES = 0.3


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

    @classmethod
    def quick(cls) -> Workload:
        return cls(num_prompts=16, new_tokens=16, reps=1, lat_new_tokens=16, lat_reps=2, copy_bytes=256 << 20,
                   matmul_n=1024)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-preset", default="tiny,llama120m",
                    help=f"comma-separated presets of pdserve.modelgen ({', '.join(PRESETS)}); default: tiny,llama120m")
    ap.add_argument("--dtype", default="both", choices=("float32", "bfloat16", "both"))
    ap.add_argument("--threads", type=int, default=2, help="torch threads for both engines (default 2)")
    ap.add_argument("--quick", action="store_true", help="16 prompts x 16 new tokens, 1 rep; a smoke run")
    ap.add_argument("--mnbt", default="8192,2048",
                    help="pdserve max_num_batched_tokens values to measure, comma-separated (default 8192,2048)")
    ap.add_argument("--reps", type=int, help="offline repetitions per engine (default 3, quick 1)")
    ap.add_argument("--lat-reps", type=int, help="latency repetitions per engine after a warm-up (default 5)")
    ap.add_argument("--models-dir", help="build models here (kept, reused next time) instead of a temp dir (removed)")
    ap.add_argument("--out", help="write all results as JSON here, e.g. docs/benchmarks-engine.json")
    ap.add_argument("--wait-idle", type=float, default=20.0,
                    help="before each measured rep, wait up to this many seconds for other processes to use < 0.25 "
                         "cores (default 20; 0 = never wait). Contention is recorded either way")
    ap.add_argument("--retries", type=int, default=2,
                    help=f"redo a rep up to this many times when other processes used >= {BUSY_CORES} cores during it")
    ap.add_argument("--no-hf", action="store_true", help="measure pdserve only (no ratios)")
    ap.add_argument("--profile", action="store_true", help="profile pdserve decode steps instead of benchmarking")
    ap.add_argument("--profile-steps", type=int, default=10, help="decode steps per profile phase (default 10)")
    args = ap.parse_args(argv)
    args.presets = [p.strip() for p in args.model_preset.split(",") if p.strip()]
    bad = [p for p in args.presets if p not in PRESETS]
    if bad:
        ap.error(f"unknown preset(s) {bad}; choose from {PRESETS}")
    args.dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    args.mnbt_list = [int(x) for x in args.mnbt.split(",") if x.strip()]
    return args


# Same thread count for every engine in this process; must be set before torch is imported.
ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)

import numpy as np  # noqa: E402
import torch  # noqa: E402

try:
    from bench import common  # python -m bench.engine
except ImportError:  # python bench/engine.py
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common  # type: ignore[no-redef]

Hardware, ModelShape, Roofline, Summary = common.Hardware, common.ModelShape, common.Roofline, common.Summary
loadavg, median = common.loadavg, common.median


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- prompts and models


def make_prompts(wl: Workload) -> tuple[list[list[int]], list[list[int]]]:
    """The anchor's prompts: 64 x 128 offline ids, then 8 x 512 latency ids, from one default_rng(0) stream."""
    rng = np.random.default_rng(0)
    offline = rng.integers(0, 4096, size=(64, wl.prompt_len)).tolist()
    latency = rng.integers(0, 4096, size=(max(8, wl.lat_reps + 1), wl.lat_prompt_len)).tolist()
    return offline[:wl.num_prompts], latency


def build_model(preset: str, root: Path) -> Path:
    from pdserve.modelgen import make_text_model
    out = root / f"llama-{preset}"
    if (out / "config.json").exists():
        return out
    t0 = time.perf_counter()
    make_text_model("llama", out, preset=preset)
    log(f"built {preset} into {out} in {time.perf_counter() - t0:.1f} s")
    return out


def kv_blocks_needed(wl: Workload, block_size: int = 16) -> int:
    per_seq = -(-(wl.prompt_len + wl.new_tokens + 1) // block_size)
    per_lat = -(-(wl.lat_prompt_len + wl.lat_new_tokens + 1) // block_size)
    return max(wl.num_prompts * per_seq, per_lat) + 16


def max_model_len(wl: Workload) -> int:
    need = max(wl.prompt_len + wl.new_tokens, wl.lat_prompt_len + wl.lat_new_tokens) + 1
    return max(1024, -(-need // 256) * 256)


def make_pdserve(model_dir: Path, dtype: str, mnbt: int, wl: Workload, threads: int) -> Any:
    from pdserve.llm import LLM
    llm = LLM(str(model_dir), dtype=dtype, max_model_len=max_model_len(wl), max_num_seqs=max(64, wl.num_prompts),
              max_num_batched_tokens=mnbt, num_kv_blocks=kv_blocks_needed(wl), enable_prefix_caching=False,
              num_threads=threads)
    return llm


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


# ----------------------------------------------------------------------------- pdserve runs


def greedy(max_tokens: int) -> Any:
    from pdserve.sampling_params import SamplingParams
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def pd_offline(llm: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """LLM.generate over all prompts; engine.step is wrapped (one perf_counter each) to split prefill from decode."""
    engine = llm.engine
    inner = engine.step
    steps: list[float] = []
    started: set[Any] = set()
    all_started_at: list[int] = []

    def timed_step() -> Any:
        t0 = time.perf_counter()
        outs = inner()
        steps.append(time.perf_counter() - t0)
        if not all_started_at:
            started.update(o.request_id for o in outs if o.new_token_ids)
            if len(started) == len(prompts):
                all_started_at.append(len(steps))
        return outs

    engine.step = timed_step
    try:
        t0 = time.perf_counter()
        results = llm.generate(prompts, greedy(new))
        wall = time.perf_counter() - t0
    finally:
        del engine.step
    produced = [len(r.outputs[0].token_ids) for r in results]
    assert all(n == new for n in produced), f"pdserve produced {set(produced)} tokens, wanted {new}"
    split = all_started_at[0] if all_started_at else len(steps)
    decode = steps[split:]
    return dict(wall_s=wall, out_tok_s=len(prompts) * new / wall, first_tokens_s=sum(steps[:split]),
                prefill_steps=split, decode_step_ms=median(decode) * 1e3, n_steps=len(steps),
                segments=steps, overhead_s=wall - sum(steps), tokens=[r.outputs[0].token_ids for r in results])


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
                e2e_ms=(times[-1] - t0) * 1e3, gaps=[b - a for a, b in zip(times, times[1:])], tokens=ids)


# ----------------------------------------------------------------------------- Hugging Face runs


def _step_timer() -> Any:
    from transformers.generation.streamers import BaseStreamer

    class StepTimer(BaseStreamer):
        """put() is called once with the prompt, then once per generated step."""

        def __init__(self) -> None:
            self.ts: list[float] = []

        def put(self, value: Any) -> None:
            self.ts.append(time.perf_counter())

        def end(self) -> None:
            pass

    return StepTimer()


def hf_generate(model: Any, prompts: list[list[int]], new: int) -> tuple[torch.Tensor, list[float], float, float]:
    ids = torch.tensor(prompts, dtype=torch.long)
    timer = _step_timer()
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
                decode_step_ms=median(decode) * 1e3, n_steps=len(ts) - 1, segments=[ts[1] - t0] + decode,
                overhead_s=wall - (ts[-1] - t0), tokens=out.tolist())


def hf_latency(model: Any, prompt: list[int], new: int) -> dict[str, Any]:
    out, ts, t0, wall = hf_generate(model, [prompt], new)
    return dict(ttft_ms=(ts[1] - t0) * 1e3, tpot_ms=(ts[-1] - ts[1]) / (new - 1) * 1e3, e2e_ms=(ts[-1] - t0) * 1e3,
                gaps=[b - a for a, b in zip(ts[1:], ts[2:])], tokens=out[0].tolist())


# ----------------------------------------------------------------------------- one model x dtype


def summarize(runs: list[dict[str, Any]], key: str) -> Summary:
    return Summary.of([r[key] for r in runs])


def steady_offline(runs: list[dict[str, Any]], num_tokens: int) -> dict[str, float]:
    """Contention-robust estimate: every step (prefill, each decode step) at its fastest over the reps, summed.

    On a shared box other processes stall some steps of every rep; the same step of another rep usually ran
    clean, so this estimates the quiet-machine time. Applied alike to both engines; equals the median on a
    quiet machine (steps vary by a few % there)."""
    n = min(len(r["segments"]) for r in runs)
    best = [min(r["segments"][k] for r in runs) for k in range(n)]
    total = sum(best) + min(r["overhead_s"] for r in runs)
    split = min(runs[0]["prefill_steps"], n)
    return dict(out_tok_s=num_tokens / total, decode_step_ms=median(best[split:]) * 1e3,
                first_tokens_s=sum(best[:split]))


def steady_latency(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Same idea for one request: fastest TTFT over reps, and each inter-token gap at its fastest over reps."""
    n = min(len(r["gaps"]) for r in runs)
    gaps = [min(r["gaps"][k] for r in runs) for k in range(n)]
    return dict(ttft_ms=min(r["ttft_ms"] for r in runs), tpot_ms=sum(gaps) / max(n, 1) * 1e3)


def count_matching(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(sequences identical, mean length of the common prefix)."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return same, int(round(sum(prefix) / max(len(prefix), 1)))


def bench_one(preset: str, model_dir: Path, dtype: str, wl: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """Measure both engines; the roofline is added later by add_roofline (after the closing hardware probe)."""
    threads = args.threads
    offline_prompts, latency_prompts = make_prompts(wl)
    shape = ModelShape.from_model_dir(model_dir)
    log(f"\n=== {preset} ({shape.total_params / 1e6:.1f}M params, {shape.streamed_params / 1e6:.1f}M streamed per step)"
        f" {dtype}, {threads} threads, load {loadavg()} ===")

    t0 = time.perf_counter()
    engines: dict[str, Any] = {f"pdserve mnbt={m}": make_pdserve(model_dir, dtype, m, wl, threads) for m in args.mnbt_list}
    if not args.no_hf:
        engines["HF generate"] = make_hf(model_dir, dtype)
    log(f"loaded {len(engines)} engines in {time.perf_counter() - t0:.1f} s")

    def run_offline(name: str) -> dict[str, Any]:
        torch.set_num_threads(threads)
        eng = engines[name]
        if name.startswith("pdserve"):
            return pd_offline(eng, offline_prompts, wl.new_tokens)
        return hf_offline(eng, offline_prompts, wl.new_tokens)

    def run_latency(name: str, prompt: list[int], new: int, tag: str) -> dict[str, Any]:
        torch.set_num_threads(threads)
        eng = engines[name]
        if name.startswith("pdserve"):
            return pd_latency(eng, prompt, new, tag)
        return hf_latency(eng, prompt, new)

    # Warm-up: allocator, oneDNN primitive caches, the batch shapes both workloads use.
    t0 = time.perf_counter()
    for name, eng in engines.items():
        torch.set_num_threads(threads)
        if name.startswith("pdserve"):
            eng.generate(offline_prompts, greedy(min(8, wl.new_tokens)))
        else:
            hf_generate(eng, offline_prompts, min(4, wl.new_tokens))
        run_latency(name, latency_prompts[-1], min(8, wl.lat_new_tokens), "warm")
    log(f"warm-up {time.perf_counter() - t0:.1f} s")

    meter = common.CpuMeter()

    def measured(fn: Any, *a: Any) -> dict[str, Any]:
        """One repetition; redone (up to --retries times) when other processes took CPU while it ran."""
        waited, retries = 0.0, 0
        while True:
            waited += meter.wait_for_quiet(args.wait_idle) if args.wait_idle > 0 else 0.0
            meter.mark()
            r = fn(*a)
            r.update(meter.since_mark(), load=loadavg())
            if r["others"] < BUSY_CORES or retries >= args.retries:
                break
            retries += 1
            log(f"    (redoing a rep: other processes used {r['others']:.2f} cores during it)")
        r.update(waited_s=waited, retries=retries)
        return r

    def busy_note(r: dict[str, Any]) -> str:
        return (f"others {r['others']:.2f} cores" + (f", waited {r['waited_s']:.0f} s" if r["waited_s"] >= 2 else "")
                + (f", {r['retries']} redone" if r["retries"] else ""))

    names = list(engines)
    offline: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rep in range(wl.reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            r = measured(run_offline, name)
            offline[name].append(r)
            log(f"  offline rep {rep} {name:<20} {r['out_tok_s']:8.1f} out tok/s  wall {r['wall_s']:6.2f} s  "
                f"decode step {r['decode_step_ms']:7.2f} ms  ({busy_note(r)})")

    latency: dict[str, list[dict[str, Any]]] = defaultdict(list)
    lat_names = [n for n in names if n.startswith("pdserve")][:1] + [n for n in names if not n.startswith("pdserve")]
    for rep in range(wl.lat_reps):
        order = lat_names if rep % 2 == 0 else lat_names[::-1]
        for name in order:
            r = measured(run_latency, name, latency_prompts[rep], wl.lat_new_tokens, f"lat-{rep}")
            latency[name].append(r)
            log(f"  latency rep {rep} {name:<20} TTFT {r['ttft_ms']:7.1f} ms  TPOT {r['tpot_ms']:6.2f} ms  "
                f"({busy_note(r)})")

    res: dict[str, Any] = dict(preset=preset, dtype=dtype, threads=threads, shape=shape, params=shape.total_params,
                               streamed_params=shape.streamed_params, workload=common.to_jsonable(wl),
                               offline={}, latency={})
    for name, runs in offline.items():
        res["offline"][name] = dict(
            out_tok_s=summarize(runs, "out_tok_s"), decode_step_ms=summarize(runs, "decode_step_ms"),
            first_tokens_s=summarize(runs, "first_tokens_s"),
            steady=steady_offline(runs, len(offline_prompts) * wl.new_tokens),
            reps=[{k: v for k, v in r.items() if k not in ("tokens", "segments")} for r in runs])
    for name, runs in latency.items():
        res["latency"][name] = dict(ttft_ms=summarize(runs, "ttft_ms"), tpot_ms=summarize(runs, "tpot_ms"),
                                    e2e_ms=summarize(runs, "e2e_ms"), steady=steady_latency(runs),
                                    reps=[{k: v for k, v in r.items() if k not in ("tokens", "gaps")} for r in runs])

    pd_names = [n for n in names if n.startswith("pdserve")]
    best_pd = max(pd_names, key=lambda n: res["offline"][n]["out_tok_s"].median)
    res["best_pdserve_offline"] = best_pd
    if not args.no_hf:
        hf_off = res["offline"]["HF generate"]["out_tok_s"].median
        res["ratios"] = dict(
            throughput={n: res["offline"][n]["out_tok_s"].median / hf_off for n in pd_names},
            throughput_best=res["offline"][best_pd]["out_tok_s"].median / hf_off,
            tpot=res["latency"][pd_names[0]]["tpot_ms"].median / res["latency"]["HF generate"]["tpot_ms"].median,
            ttft=res["latency"][pd_names[0]]["ttft_ms"].median / res["latency"]["HF generate"]["ttft_ms"].median,
            steady_throughput_best=max(res["offline"][n]["steady"]["out_tok_s"] for n in pd_names)
            / res["offline"]["HF generate"]["steady"]["out_tok_s"],
            steady_tpot=res["latency"][pd_names[0]]["steady"]["tpot_ms"] / res["latency"]["HF generate"]["steady"]["tpot_ms"],
            steady_ttft=res["latency"][pd_names[0]]["steady"]["ttft_ms"] / res["latency"]["HF generate"]["steady"]["ttft_ms"],
        )
        same, prefix = count_matching(offline[pd_names[0]][0]["tokens"], offline["HF generate"][0]["tokens"])
        lsame, lprefix = count_matching([latency[pd_names[0]][0]["tokens"]], [latency["HF generate"][0]["tokens"]])
        res["agreement"] = dict(offline_identical=same, offline_n=len(offline_prompts), offline_mean_common_prefix=prefix,
                                latency_identical=lsame, latency_common_prefix=lprefix)
    all_reps = [r for runs in (*offline.values(), *latency.values()) for r in runs]
    res["contention"] = dict(others_max=max(r["others"] for r in all_reps),
                             others_mean=sum(r["others"] for r in all_reps) / len(all_reps),
                             steal_max=max(r["steal"] for r in all_reps))
    res["peak_rss_mib"] = common.peak_rss_mib()
    if "ratios" in res:
        ra = res["ratios"]
        log(f"  => pdserve/HF throughput {ra['throughput_best']:.2f}x ({best_pd}), TPOT {ra['tpot']:.2f}x, "
            f"TTFT {ra['ttft']:.2f}x; steady estimates: {ra['steady_throughput_best']:.2f}x, "
            f"{ra['steady_tpot']:.2f}x, {ra['steady_ttft']:.2f}x")
    del engines
    gc.collect()
    return res


# ----------------------------------------------------------------------------- report


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def add_roofline(res: dict[str, Any], hw: Hardware, wl: Workload) -> None:
    """Bounds for the same workloads on this machine, and each measurement's share of them (bound / measured)."""
    roof = Roofline(res["shape"], getattr(torch, res["dtype"]), hw)
    off_bound = roof.generation(wl.num_prompts, wl.prompt_len, wl.new_tokens)
    ttft_bound = roof.prefill(1, wl.lat_prompt_len)
    tpot_steps = [roof.decode(1, wl.lat_prompt_len + k) for k in range(1, wl.lat_new_tokens)]
    tpot_bound_ms = sum(s.seconds for s in tpot_steps) / len(tpot_steps) * 1e3
    res["roofline"] = dict(offline=off_bound, ttft_ms=ttft_bound.seconds * 1e3, ttft_limit=ttft_bound.limit,
                           tpot_ms=tpot_bound_ms, tpot_limit=tpot_steps[len(tpot_steps) // 2].limit)
    for r in res["offline"].values():
        r["roofline_share"] = r["out_tok_s"].median / off_bound["out_tok_s"]
        r["steady"]["roofline_share"] = r["steady"]["out_tok_s"] / off_bound["out_tok_s"]
    for r in res["latency"].values():
        r["ttft_roofline_share"] = ttft_bound.seconds * 1e3 / r["ttft_ms"].median
        r["tpot_roofline_share"] = tpot_bound_ms / r["tpot_ms"].median
        r["steady"]["ttft_roofline_share"] = ttft_bound.seconds * 1e3 / r["steady"]["ttft_ms"]
        r["steady"]["tpot_roofline_share"] = tpot_bound_ms / r["steady"]["tpot_ms"]


def print_result(res: dict[str, Any], wl: Workload) -> None:
    rf = res["roofline"]
    ob = rf["offline"]
    log(f"\n--- {res['preset']} {res['dtype']}: offline {wl.num_prompts} x {wl.prompt_len} -> {wl.new_tokens}; "
        f"median (min-max) of {wl.reps} | steady = each step at its fastest over the reps ---")
    log(f"  {'engine':<20} {'out tok/s':>20} {'decode step ms':>20} {'1st tok s':>9} {'%roof':>6} |"
        f" {'steady tok/s':>12} {'step ms':>8} {'%roof':>6}")
    for name, r in res["offline"].items():
        st = r["steady"]
        log(f"  {name:<20} {r['out_tok_s'].fmt('.0f'):>20} {r['decode_step_ms'].fmt('.1f'):>20} "
            f"{r['first_tokens_s'].median:>9.2f} {_pct(r['roofline_share']):>6} | {st['out_tok_s']:>12.0f} "
            f"{st['decode_step_ms']:>8.1f} {_pct(st['roofline_share']):>6}")
    step_cell = f"{ob['decode_step_ms']:.1f} ({ob['decode_limit']})"
    log(f"  {'roofline':<20} {ob['out_tok_s']:>20.0f} {step_cell:>20} {ob['prefill_s']:>9.2f} {'100%':>6} |"
        f"  prefill {ob['prefill_limit']}-bound; mid-run decode step: compute {ob['decode_mid_compute_ms']:.1f} ms,"
        f" memory {ob['decode_mid_memory_ms']:.1f} ms")
    log(f"--- {res['preset']} {res['dtype']}: latency {wl.lat_prompt_len} -> {wl.lat_new_tokens}; "
        f"median (min-max) of {wl.lat_reps} | steady ---")
    log(f"  {'engine':<20} {'TTFT ms':>22} {'TPOT ms':>20} {'%roof':>6} {'%roof':>6} | {'TTFT ms':>8} {'TPOT ms':>8}"
        f" {'%roof':>6} {'%roof':>6}")
    for name, r in res["latency"].items():
        st = r["steady"]
        log(f"  {name:<20} {r['ttft_ms'].fmt('.1f'):>22} {r['tpot_ms'].fmt('.2f'):>20} "
            f"{_pct(r['ttft_roofline_share']):>6} {_pct(r['tpot_roofline_share']):>6} | {st['ttft_ms']:>8.1f} "
            f"{st['tpot_ms']:>8.2f} {_pct(st['ttft_roofline_share']):>6} {_pct(st['tpot_roofline_share']):>6}")
    ttft_cell, tpot_cell = f"{rf['ttft_ms']:.1f} ({rf['ttft_limit']})", f"{rf['tpot_ms']:.2f} ({rf['tpot_limit']})"
    log(f"  {'roofline':<20} {ttft_cell:>22} {tpot_cell:>20}")
    if "ratios" in res:
        ra, ag = res["ratios"], res["agreement"]
        tput = ", ".join(f"{n.split()[-1]}: {v:.2f}x" for n, v in ra["throughput"].items())
        log(f"  pdserve/HF: throughput {tput} | TPOT {ra['tpot']:.2f}x | TTFT {ra['ttft']:.2f}x"
            f"  (steady: {ra['steady_throughput_best']:.2f}x | {ra['steady_tpot']:.2f}x | {ra['steady_ttft']:.2f}x)")
        log(f"  greedy ids identical to HF: offline {ag['offline_identical']}/{ag['offline_n']} "
            f"(mean common prefix {ag['offline_mean_common_prefix']} tokens), latency prompt "
            f"{'yes' if ag['latency_identical'] else 'no (common prefix %d)' % ag['latency_common_prefix']}")
    c = res["contention"]
    log(f"  other processes during measured reps: mean {c['others_mean']:.2f}, max {c['others_max']:.2f} cores"
        f"{'  <- SUSPECT: trust the steady columns more' if c['others_max'] >= BUSY_CORES else ''}")
    if res["streamed_params"] * (2 if res["dtype"] == "bfloat16" else 4) < 32 << 20:
        log("  note: the weights fit in L3 here, so the DRAM roofline is not a hard bound; per-step overhead dominates")


def _target_cell(value: float, target: float | None, ok_if_ge: bool, preset: str) -> str:
    if target is None:
        return "-"
    ok = value >= target if ok_if_ge else value <= target
    sign = ">=" if ok_if_ge else "<="
    if preset != TARGET_PRESET:
        return f"({sign}{target})"
    return f"{sign}{target} {'PASS' if ok else 'MISS'}"


def print_summary(results: list[dict[str, Any]]) -> None:
    log("\n=== summary: pdserve / HF, medians [steady estimates]; targets are set for llama120m ===")
    log(f"{'model':<10} {'dtype':<8} {'pd tok/s':>13} {'HF tok/s':>13} {'tput x':>14} {'target':>12} {'pd %roof':>10} "
        f"{'HF %roof':>10} | {'pd TPOT':>13} {'HF TPOT':>13} {'TPOT x':>13} {'target':>13} {'pd %roof':>10} | "
        f"{'TTFT x':>13} | {'others':>6}")
    for r in results:
        if "ratios" not in r:
            continue
        best = r["best_pdserve_offline"]
        pd_off, hf_off = r["offline"][best], r["offline"]["HF generate"]
        pd_name = [n for n in r["latency"] if n.startswith("pdserve")][0]
        pd_lat, hf_lat = r["latency"][pd_name], r["latency"]["HF generate"]
        ra = r["ratios"]
        pds, hfs = max((r["offline"][n]["steady"] for n in r["offline"] if n.startswith("pdserve")),
                       key=lambda x: x["out_tok_s"]), hf_off["steady"]
        log(f"{r['preset']:<10} {r['dtype']:<8} "
            f"{pd_off['out_tok_s'].median:>6.0f} [{pds['out_tok_s']:>4.0f}] {hf_off['out_tok_s'].median:>6.0f} "
            f"[{hfs['out_tok_s']:>4.0f}] {ra['throughput_best']:>5.2f}x [{ra['steady_throughput_best']:.2f}x] "
            f"{_target_cell(ra['steady_throughput_best'], TARGET_THROUGHPUT.get(r['dtype']), True, r['preset']):>12} "
            f"{_pct(pd_off['roofline_share']):>4} [{_pct(pds['roofline_share']):>3}] "
            f"{_pct(hf_off['roofline_share']):>4} [{_pct(hfs['roofline_share']):>3}] | "
            f"{pd_lat['tpot_ms'].median:>5.1f} [{pd_lat['steady']['tpot_ms']:>5.1f}] "
            f"{hf_lat['tpot_ms'].median:>5.1f} [{hf_lat['steady']['tpot_ms']:>5.1f}] "
            f"{ra['tpot']:>4.2f}x [{ra['steady_tpot']:.2f}x] "
            f"{_target_cell(ra['steady_tpot'], TARGET_TPOT.get(r['dtype']), False, r['preset']):>13} "
            f"{_pct(pd_lat['tpot_roofline_share']):>4} [{_pct(pd_lat['steady']['tpot_roofline_share']):>3}] | "
            f"{ra['ttft']:>4.2f}x [{ra['steady_ttft']:.2f}x] | {r['contention']['others_max']:>6.2f}")
    log("(tput x: best pdserve max_num_batched_tokens; TPOT/TTFT x < 1 means pdserve is faster; PASS/MISS is judged on\n"
        " the steady estimate; others = most cores other processes used during any measured rep, above ~0.3 the\n"
        " medians are suspect and the steady estimates are the better guide)")


# ----------------------------------------------------------------------------- profile mode


class Timers:
    """Inclusive perf_counter totals per name; wrappers are installed on instances and module globals."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        if not hasattr(owner, attr):
            return
        fn = getattr(owner, attr)
        had_own = isinstance(owner, type(sys)) or attr in getattr(owner, "__dict__", {})
        total, calls = self.total, self.calls

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                total[name] += time.perf_counter() - t0
                calls[name] += 1

        self._undo.append((owner, attr, fn, had_own))
        setattr(owner, attr, timed)

    def undo(self) -> None:
        for owner, attr, fn, had_own in reversed(self._undo):
            if had_own:
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr)
        self._undo.clear()

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()


# (name, parent) in print order; a parent's "other" is its time minus its children's.
PROFILE_TREE = [
    ("step", None),
    ("schedule", "step"),
    ("execute_model", "step"),
    ("prepare (batch tensors, block tables)", "execute_model"),
    ("forward", "execute_model"),
    ("embed", "forward"),
    ("rmsnorm", "forward"),
    ("linear qkv", "forward"),
    ("rope", "forward"),
    ("attention", "forward"),
    ("write_kv", "attention"),
    ("decode attention (gather+fp32+bmm+softmax)", "attention"),
    ("prefill attention", "attention"),
    ("linear o_proj", "forward"),
    ("linear gate_up", "forward"),
    ("silu_and_mul", "forward"),
    ("linear down", "forward"),
    ("lm_head (compute_logits)", "execute_model"),
    ("sample", "execute_model"),
    ("update_from_output", "step"),
    ("output processing (detokenize)", "step"),
]


def instrument(engine: Any, timers: Timers) -> None:
    import pdserve.engine.model_runner as runner_mod
    import pdserve.layers.attention as attn_mod
    import pdserve.models.llama as llama_mod

    runner, model = engine.runner, engine.runner.model
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(runner, "execute_model", "execute_model")
    timers.wrap(runner, "_prepare", "prepare (batch tensors, block tables)")
    timers.wrap(model, "forward", "forward")
    timers.wrap(model, "embed", "embed")
    timers.wrap(model, "norm", "rmsnorm")
    for layer in model.layers:
        for attr, name in (("input_norm", "rmsnorm"), ("post_attention_norm", "rmsnorm"), ("qkv", "linear qkv"),
                           ("o_proj", "linear o_proj"), ("gate_up", "linear gate_up"), ("down", "linear down"),
                           ("rotary", "rope")):
            timers.wrap(layer, attr, name)
    timers.wrap(llama_mod, "paged_attention", "attention")
    timers.wrap(llama_mod, "silu_and_mul", "silu_and_mul")
    timers.wrap(attn_mod, "write_kv", "write_kv")
    timers.wrap(attn_mod, "_decode_attention", "decode attention (gather+fp32+bmm+softmax)")
    timers.wrap(attn_mod, "_prefill_attention", "prefill attention")
    timers.wrap(model, "compute_logits", "lm_head (compute_logits)")
    timers.wrap(runner_mod, "sample", "sample")
    timers.wrap(engine.scheduler, "update_from_output", "update_from_output")
    timers.wrap(engine, "_process", "output processing (detokenize)")


def print_tree(timers: Timers, steps: int, step_ms: float) -> dict[str, float]:
    per_step = {name: timers.total.get(name, 0.0) * 1e3 / steps for name, _ in PROFILE_TREE}
    per_step["step"] = step_ms
    depth = {}
    for name, parent in PROFILE_TREE:
        depth[name] = 0 if parent is None else depth[parent] + 1
    children: dict[str, list[str]] = defaultdict(list)
    for name, parent in PROFILE_TREE:
        if parent:
            children[parent].append(name)
    for name, _ in PROFILE_TREE:
        if name != "step" and name not in timers.total:
            continue
        ms = per_step[name]
        calls = timers.calls.get(name, steps) / steps
        log(f"    {'  ' * depth[name]}{name:<{46 - 2 * depth[name]}} {ms:8.2f} ms {100 * ms / step_ms:5.1f}%"
            f"  ({calls:.0f} calls/step)")
        kids = [c for c in children.get(name, []) if c in timers.total]
        if kids:
            other = ms - sum(per_step[c] for c in kids)
            log(f"    {'  ' * (depth[name] + 1)}{'(other)':<{44 - 2 * depth[name]}} {other:8.2f} ms "
                f"{100 * other / step_ms:5.1f}%")
    return per_step


def profile_one(preset: str, model_dir: Path, dtype: str, hw: Hardware, wl: Workload, args: argparse.Namespace
                ) -> dict[str, Any]:
    """Three phases of pdserve alone: the offline prefill (all prompts), a batch-64 decode step, a batch-1 one."""
    from torch.profiler import ProfilerActivity, profile

    threads = args.threads
    shape = ModelShape.from_model_dir(model_dir)
    elem = 2 if dtype == "bfloat16" else 4
    offline_prompts, latency_prompts = make_prompts(wl)
    mnbt = args.mnbt_list[0]
    llm = make_pdserve(model_dir, dtype, mnbt, wl, threads)
    engine = llm.engine
    n = args.profile_steps
    ids = iter(range(1 << 30))
    out: dict[str, Any] = dict(preset=preset, dtype=dtype, threads=threads, mnbt=mnbt, scenarios={})
    scenarios = [("prefill", f"prefill of {len(offline_prompts)} x {wl.prompt_len} (mnbt {mnbt})", offline_prompts),
                 ("decode", f"batch {len(offline_prompts)} decode step (prompt {wl.prompt_len})", offline_prompts),
                 ("decode", f"batch 1 decode step (prompt {wl.lat_prompt_len})", latency_prompts[:1])]
    for kind, title, prompts in scenarios:
        torch.set_num_threads(threads)
        meter = common.CpuMeter()
        if args.wait_idle > 0:
            meter.wait_for_quiet(args.wait_idle)
        meter.mark()
        if kind == "prefill":
            def unit() -> None:  # the whole prefill of every prompt (one step when they fit in mnbt)
                for p in prompts:
                    engine.add_request(f"prof-{next(ids)}", p, greedy(1))
                while engine.has_unfinished_requests():
                    engine.step()
            warm, plain, instr, prof_units = 1, 2, 1, 1
            tokens, rows, unit_name = len(prompts) * len(prompts[0]), len(prompts), "prefill"
            context = len(prompts[0])
        else:
            warm, plain, instr, prof_units = 3, n, n, max(3, n // 2)
            for p in prompts:
                engine.add_request(f"prof-{next(ids)}", p, greedy(2 + warm + plain + instr + prof_units))
            started: set[Any] = set()
            while len(started) < len(prompts):  # prefill
                started.update(o.request_id for o in engine.step() if o.new_token_ids)
            unit = engine.step
            tokens = rows = len(prompts)
            unit_name = "step"
            context = len(prompts[0]) + warm + plain + instr // 2
        for _ in range(warm):
            unit()
        times = []
        for _ in range(plain):
            t0 = time.perf_counter()
            unit()
            times.append(time.perf_counter() - t0)
        timers = Timers()
        instrument(engine, timers)
        t0 = time.perf_counter()
        for _ in range(instr):
            unit()
        instrumented_ms = (time.perf_counter() - t0) / instr * 1e3
        timers.undo()
        log(f"\n--- profile {preset} {dtype} {threads} thr: {title}, context ~{context}: {unit_name} "
            f"{median(times) * 1e3:.2f} ms (median of {plain}, min {min(times) * 1e3:.2f}); {instrumented_ms:.2f} ms "
            f"with {sum(timers.calls.values()) // instr} timing wrappers per {unit_name}")
        per_unit = print_tree(timers, instr, instrumented_ms)
        lin_ms = sum(per_unit.get(k, 0.0) for k in ("linear qkv", "linear o_proj", "linear gate_up", "linear down"))
        head_ms = per_unit.get("lm_head (compute_logits)", 0.0)
        if lin_ms > 0:
            log(f"    layer linears: {2 * shape.linear_params * tokens / lin_ms / 1e6:.0f} GFLOP/s, "
                f"{shape.linear_params * elem / lin_ms / 1e6:.1f} GB/s of weights (machine: "
                f"{hw.peak_flops(getattr(torch, dtype)) / 1e9:.0f} GFLOP/s, {hw.copy_GBps_best:.1f} GB/s)")
        if head_ms > 0:
            log(f"    lm_head: {2 * shape.lm_head_params * rows / head_ms / 1e6:.0f} GFLOP/s, "
                f"{shape.lm_head_params * elem / head_ms / 1e6:.1f} GB/s of weights")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(prof_units):
                unit()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total_self = sum(e.self_cpu_time_total for e in events) or 1.0
        log(f"    torch.profiler over {prof_units} {unit_name}(s): top ops by self CPU time, per {unit_name}")
        top = []
        for e in events[:14]:
            ms = e.self_cpu_time_total / 1e3 / prof_units
            top.append(dict(op=e.key, self_ms=ms, share=e.self_cpu_time_total / total_self,
                            calls=e.count / prof_units))
            log(f"      {e.key[:52]:<52} {ms:9.2f} ms {100 * e.self_cpu_time_total / total_self:5.1f}%  "
                f"{e.count / prof_units:6.0f} calls")
        while engine.has_unfinished_requests():
            engine.step()
        busy = meter.since_mark()
        log(f"    (other processes used {busy['others']:.2f} cores meanwhile"
            f"{'; SUSPECT' if busy['others'] >= BUSY_CORES else ''})")
        out["scenarios"][title] = dict(
            others=busy["others"], unit=unit_name, ms_median=median(times) * 1e3, ms_min=min(times) * 1e3,
            instrumented_ms=instrumented_ms, breakdown_ms=per_unit,
            calls={k: v / instr for k, v in timers.calls.items()}, top_ops=top)
    del llm, engine
    gc.collect()
    out["attention_whatif"] = [
        attention_whatif(shape, dtype, len(offline_prompts), wl.prompt_len + wl.new_tokens // 2),
        attention_whatif(shape, dtype, 1, wl.lat_prompt_len + wl.lat_new_tokens // 2)]
    return out


def attention_whatif(shape: ModelShape, dtype: str, batch: int, context: int, block_size: int = 16,
                     reps: int = 20) -> dict[str, Any]:
    """One layer's decode attention on a synthetic paged cache (blocks scattered like a real one): pdserve's
    function as it is, its gather/copy parts alone, and the same math on K/V that are already contiguous."""
    import torch.nn.functional as F
    from pdserve.layers.attention import AttentionMetadata, _decode_attention, gather_blocks

    dt = getattr(torch, dtype)
    kv, hd, heads, group = shape.kv_heads, shape.head_dim, shape.heads, shape.heads // shape.kv_heads
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq + 1
    cache = torch.randn(num_blocks, 2, 2, kv, block_size, hd).to(dt)  # 2 layers suffice for the strided view
    layer = cache[:, 1]
    table = (torch.randperm(num_blocks - 1)[:batch * per_seq] + 1).view(batch, per_seq)
    padded = per_seq * block_size
    visible = torch.arange(padded).unsqueeze(0) < torch.full((batch, 1), context)
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf")).view(batch, 1, 1, padded)
    meta = AttentionMetadata(slot_block=torch.zeros(batch, dtype=torch.long), slot_offset=torch.zeros(batch, dtype=torch.long),
                             num_decode_tokens=batch, decode_block_table=table, decode_bias=bias)
    q = torch.randn(batch, heads, hd).to(dt)
    scale = hd ** -0.5
    k32, v32 = torch.randn(batch, kv, padded, hd), torch.randn(batch, kv, padded, hd)
    kdt, vdt = k32.to(dt), v32.to(dt)

    def block_major_gather_copy() -> torch.Tensor:  # how pdserve gathered before gather_blocks
        blocks = layer.index_select(0, table.reshape(-1))
        return blocks.view(batch, per_seq, 2, kv, block_size, hd).permute(2, 0, 3, 1, 4, 5).to(torch.float32).reshape(
            2, batch, kv, padded, hd)

    def math(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qg = q.to(k.dtype).view(batch, kv, group, hd)
        scores = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(scale).add_(bias)
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)

    variants = {
        "pdserve _decode_attention (as is)": lambda: _decode_attention(q, layer, meta, scale),
        "  gather_blocks alone (head-major)": lambda: gather_blocks(layer, table.reshape(-1)),
        "  block-major gather + permute copy": block_major_gather_copy,
        "same math, K/V contiguous fp32": lambda: math(k32, v32),
    }
    if dt != torch.float32:
        variants[f"same math, K/V contiguous {dtype}"] = lambda: math(kdt, vdt)
    variants[f"SDPA, K/V contiguous {dtype}"] = lambda: F.scaled_dot_product_attention(
        q.view(batch, heads, 1, hd), kdt, vdt, attn_mask=bias.to(dt), scale=scale, enable_gqa=True)
    kv_bytes = batch * context * 2 * kv * hd * cache.element_size()
    out: dict[str, Any] = dict(batch=batch, context=context, dtype=dtype, kv_bytes_per_layer=kv_bytes, ms={}, ms_min={})
    meter = common.CpuMeter()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        for _ in range(3):
            fn()
    for _ in range(reps):  # round-robin, so that a stall hits every variant alike
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    busy = meter.since_mark()["others"]
    log(f"    decode attention what-if, {dtype}, batch {batch}, context {context} ({kv_bytes / 1e6:.1f} MB of K/V per "
        f"layer): ms per layer, median (min) of {reps}, x{shape.layers} layers = ms per step "
        f"(others {busy:.2f} cores{'; SUSPECT' if busy >= BUSY_CORES else ''})")
    for name, ts in times.items():
        out["ms"][name], out["ms_min"][name] = median(ts) * 1e3, min(ts) * 1e3
        log(f"      {name:<40} {median(ts) * 1e3:8.3f} ({min(ts) * 1e3:.3f}) ms  {median(ts) * 1e3 * shape.layers:7.2f} "
            f"({min(ts) * 1e3 * shape.layers:.2f}) ms/step  {kv_bytes / min(ts) / 1e9:6.1f} GB/s of K/V at best")
    out["others"] = busy
    return out


# ----------------------------------------------------------------------------- main


def main(args: argparse.Namespace) -> int:
    wl = Workload.quick() if args.quick else Workload()
    if args.reps:
        wl.reps = args.reps
    if args.lat_reps:
        wl.lat_reps = args.lat_reps
    torch.set_num_threads(args.threads)
    log(f"bench/engine.py: presets {args.presets}, dtypes {args.dtypes}, {args.threads} threads, "
        f"{'quick' if args.quick else 'full'}, mnbt {args.mnbt_list}, load {loadavg()}")
    t_start = time.perf_counter()
    meter = common.CpuMeter()
    if args.wait_idle > 0:
        meter.wait_for_quiet(args.wait_idle)
    hw = common.probe_hardware(args.threads, copy_bytes=wl.copy_bytes, matmul_n=wl.matmul_n)
    probes = [hw]
    log("hardware: " + hw.describe())

    own_tmp = args.models_dir is None
    root = Path(tempfile.mkdtemp(prefix="pdserve-bench-")) if own_tmp else Path(args.models_dir)
    root.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    profiles: list[dict[str, Any]] = []
    try:
        for preset in args.presets:
            model_dir = build_model(preset, root)
            for dtype in args.dtypes:
                if args.profile:
                    profiles.append(profile_one(preset, model_dir, dtype, hw, wl, args))
                else:
                    results.append(bench_one(preset, model_dir, dtype, wl, args))
    finally:
        if own_tmp:
            shutil.rmtree(root, ignore_errors=True)
    if results:
        # Memory bandwidth on this shared host swings by 2x from minute to minute: probe again, keep the best.
        if args.wait_idle > 0:
            meter.wait_for_quiet(args.wait_idle)
        end_hw = common.probe_hardware(args.threads, copy_bytes=wl.copy_bytes, matmul_n=wl.matmul_n)
        probes.append(end_hw)
        log("\nhardware at the end: " + end_hw.describe())
        hw = common.best_of(hw, end_hw)
        log(f"roofline uses copy {hw.copy_GBps_best:.1f} GB/s, matmul fp32 {hw.matmul_fp32_GFLOPs_best:.0f} / "
            f"bf16 {hw.matmul_bf16_GFLOPs_best:.0f} GFLOP/s (best of both probes)")
        for res in results:
            add_roofline(res, hw, wl)
            print_result(res, wl)
        print_summary(results)
    log(f"\ntotal {time.perf_counter() - t_start:.0f} s, peak RSS {common.peak_rss_mib():.0f} MiB, load {loadavg()}")
    if args.out:
        payload = dict(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), argv=sys.argv[1:], threads=args.threads,
                       quick=args.quick, torch=torch.__version__, hardware=hw, probes=probes, results=results, profiles=profiles,
                       targets=dict(preset=TARGET_PRESET, throughput=TARGET_THROUGHPUT, tpot=TARGET_TPOT))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(common.to_jsonable(payload), indent=1) + "\n")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
