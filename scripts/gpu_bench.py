"""A small side-by-side timing of pdserve's engine and transformers' generate on one device (scripts/gpu_check.sh
runs it on a GPU): time to first token of one prompt per length, and batch-1 decode tokens/s, per dtype, each after
a warm-up. Prints one line per measurement and writes them all as JSON.

    python3 scripts/gpu_bench.py --model DIR --out gpu_bench.json [--device cuda] [--lengths 512 2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.llm import LLM  # noqa: E402 - after the repository joins the path
from pdserve.sampling_params import SamplingParams  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int) -> float:
    """Median seconds of `reps` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(0, 4096, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def bench_pdserve(model: Path, device: str, dtype: str, lengths: list[int], decode_tokens: int,
                  reps: int) -> dict[str, Any]:
    longest = max(lengths)
    llm = LLM(str(model), device=device, dtype=dtype, max_model_len=max(longest + 64, 256 + decode_tokens),
              max_num_batched_tokens=max(longest, 2048), enable_prefix_caching=False, num_kv_blocks=1024)
    greedy = dict(temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}
    for n in lengths:
        prompt = prompt_of(n, n)  # the same prompt each rep: no prefix caching, so each one is computed again
        out[f"ttft_{n}_ms"] = 1e3 * timed(lambda: llm.generate([prompt], SamplingParams(max_tokens=1, **greedy)),
                                          device, reps)
    prompt = prompt_of(128, 1)
    one = timed(lambda: llm.generate([prompt], SamplingParams(max_tokens=1, **greedy)), device, reps)
    full = timed(lambda: llm.generate([prompt], SamplingParams(max_tokens=decode_tokens, **greedy)), device, reps)
    out["decode_tok_s_batch1"] = (decode_tokens - 1) / (full - one)
    batch = [prompt_of(128, 100 + i) for i in range(32)]
    start = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=decode_tokens, **greedy))
    sync(device)
    out["generate_tok_s_batch32"] = 32 * decode_tokens / (time.perf_counter() - start)
    assert llm.engine.kv.num_used_blocks == 0
    return out


def bench_transformers(model: Path, device: str, dtype: str, lengths: list[int], decode_tokens: int,
                       reps: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()

    def generate(prompt: list[int], new: int) -> None:
        config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
        with torch.no_grad():
            hf.generate(torch.tensor([prompt], device=device), generation_config=config)

    out: dict[str, Any] = {}
    for n in lengths:
        prompt = prompt_of(n, n)
        out[f"ttft_{n}_ms"] = 1e3 * timed(lambda: generate(prompt, 1), device, reps)
    prompt = prompt_of(128, 1)
    one = timed(lambda: generate(prompt, 1), device, reps)
    full = timed(lambda: generate(prompt, decode_tokens), device, reps)
    out["decode_tok_s_batch1"] = (decode_tokens - 1) / (full - one)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = {"device": args.device, "model": str(args.model), "torch": torch.__version__}
    if args.device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name()
    engines = [("pdserve", bench_pdserve)] + ([] if args.no_transformers else [("transformers", bench_transformers)])
    for dtype in args.dtypes:
        for name, bench in engines:
            key = f"{name}_{dtype}"
            try:
                results[key] = bench(args.model, args.device, dtype, args.lengths, args.decode_tokens, args.reps)
            except Exception as exc:  # noqa: BLE001 - one failed measurement must not lose the others
                results[key] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"BENCH {key}: {json.dumps(results[key])}", flush=True)
            args.out.write_text(json.dumps(results, indent=2))  # after each: a timeout keeps what was measured
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
