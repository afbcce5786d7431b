"""Where one decode step's, or one prefill's, time goes, for any engine that can be stepped in-process:
torch.profiler with Python stacks around `step()`, every op's self time put in a category.

Decode steps: linears / lm_head / attention / other ops, and the step's Python time outside the model's layers
(scheduling, batch preparation, output processing) as "outside ops". Prefills (one prompt, one sampled token, from
`add` to the step that finished it): linears / lm_head / attention / rotary and the KV cache write / norms and
SiLU x mul / sampling / other ops, and the interpreter's own time anywhere ("Python", between ops).

Classification by the Python frames an op ran under (with_stack makes every Python call an event, the parent of the
ops it calls): lm_head under the model's compute_logits / logits processor; attention when the innermost source
file is an attention module; linears when the op is a GEMM (or under vLLM's layers/linear.py); other ops; Python
self time elsewhere is "outside ops". Shares are of the profiled time, applied to the unprofiled median step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from harness import timeit

CATEGORIES = ("linears", "lm_head", "attention", "other ops", "outside ops")
PREFILL_CATEGORIES = ("linears", "lm_head", "attention", "rotary+cache", "norms+act", "sampling", "other ops", "Python")
GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm", "_C::onednn_mm",
            "aten::_mkl_linear", "_C::onednn_scaled_mm")


def _frames_class(chain: list[str]) -> str | None:
    """chain: an event's name, then its parents' (Python frames appear as events named 'path(line): function')."""
    if any("compute_logits" in f or "logits_processor" in f for f in chain):
        return "lm_head"
    for frame in chain:  # innermost first
        path = frame.split("(", 1)[0]
        if ".py" not in path:
            continue
        if "attention" in path or "attn" in path:
            return "attention"
        if path.endswith("layers/linear.py") and "vllm" in path:
            return "linears"
    return None


def _is_python(name: str) -> bool:
    return ".py(" in name or name.startswith("<built-in")  # a Python frame or C call, not an op


def _main_thread_chains(events: Any) -> Iterator[tuple[Any, list[str]]]:
    """(event, its name and its parents' names) for the events of the thread that ran the steps."""
    per_thread: dict[int, int] = {}  # events per thread; an idle helper thread has few, long ones (a wait)
    for ev in events:
        per_thread[ev.thread] = per_thread.get(ev.thread, 0) + 1
    main = max(per_thread, key=per_thread.__getitem__)
    for ev in events:
        if ev.thread != main:
            continue
        chain, parent = [ev.name], ev.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        yield ev, chain


def categorize(events: Any) -> dict[str, float]:
    """Self CPU microseconds per decode category over a profile's events, on the thread that ran the steps."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for ev, chain in _main_thread_chains(events):
        cls = _frames_class(chain)
        if cls is None:
            cls = "linears" if ev.name in GEMM_OPS else "outside ops" if _is_python(ev.name) else "other ops"
        out[cls] += ev.self_cpu_time_total
    return out


# Ops named for what they do, in either engine (pdserve's native ops, vLLM's _C ops).
ROTARY_CACHE_OP_WORDS = ("rotary", "reshape_and_cache")
NORM_ACT_OP_WORDS = ("rms_norm", "silu_and_mul")
# Python functions of either engine's plain-torch paths, by name, innermost frame first.
ROTARY_CACHE_FUNCTIONS = ("apply_rotary", "_rotate", "write_kv", "rotary_and_cache")
NORM_ACT_FUNCTIONS = ("rms_norm", "add_rms_norm", "silu_and_mul")


def _prefill_op_class(name: str, chain: list[str]) -> str:
    """A prefill op's category: by what contains it (lm_head, sampler), then by its own name, then by the
    innermost Python frame that says what it is part of."""
    if any("compute_logits" in f or "logits_processor" in f for f in chain):
        return "lm_head"
    if any("sampler.py(" in f for f in chain):
        return "sampling"
    if any(w in name for w in ROTARY_CACHE_OP_WORDS):
        return "rotary+cache"
    if any(w in name for w in NORM_ACT_OP_WORDS):
        return "norms+act"
    for frame in chain[1:]:  # innermost first
        path, _, function = frame.partition("): ")
        if ".py(" not in path:
            continue
        if function in ROTARY_CACHE_FUNCTIONS or "rotary" in path:
            return "rotary+cache"
        if function in NORM_ACT_FUNCTIONS or "layernorm" in path or "activation" in path:
            return "norms+act"
        if "attention" in path or "attn" in path:
            return "attention"
        if path.endswith("layers/linear.py") and "vllm" in path:
            return "linears"
    return "linears" if name in GEMM_OPS else "other ops"


def categorize_prefill(events: Any) -> dict[str, float]:
    """Self CPU microseconds per prefill category; the interpreter's own time is "Python" wherever it runs."""
    out = dict.fromkeys(PREFILL_CATEGORIES, 0.0)
    for ev, chain in _main_thread_chains(events):
        cls = "Python" if _is_python(ev.name) else _prefill_op_class(ev.name, chain)
        out[cls] += ev.self_cpu_time_total
    return out


def profile_decode(add: Callable[[list[list[int]], int], None], step: Callable[[], Any],
                   unfinished: Callable[[], bool], batches: dict[str, list[list[int]]], n: int) -> dict[str, Any]:
    """For each named batch of prompts: decode steps timed n times, then n more under the profiler; ms per step."""
    from torch.profiler import ProfilerActivity, profile

    res = {}
    for title, prompts in batches.items():
        add(prompts, 3 * n + 8)
        for _ in range(3):  # the prefill (one step at these sizes) and two decode steps
            step()
        walls = timeit(step, reps=n, warmup=0)
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
            t = time.perf_counter()
            for _ in range(n):
                step()
            profiled_wall = time.perf_counter() - t
        while unfinished():
            step()
        # Shares of the profiled time, applied to the unprofiled step (the profiler slows Python down most).
        split = categorize(prof.events())
        wall_ms, total = statistics.median(walls) * 1e3, sum(split.values()) or 1.0
        res[title] = dict(step_ms=wall_ms, profiled_step_ms=profiled_wall * 1e3 / n,
                          **{k: wall_ms * v / total for k, v in split.items()})
    return res


def profile_prefill(add: Callable[[list[list[int]], int], None], step: Callable[[], Any],
                    unfinished: Callable[[], bool], prompts: dict[str, list[int]], n: int) -> dict[str, Any]:
    """For each named prompt: its prefill (add it for one token, step until it finished) timed n times, then twice
    more under the profiler; ms per prefill (the fastest of the n: other processes only ever add time), split by the
    shares of the faster profiled run."""
    from torch.profiler import ProfilerActivity, profile

    def prefill(prompt: list[int]) -> None:
        add([prompt], 1)
        while unfinished():
            step()

    res = {}
    for title, prompt in prompts.items():
        walls = timeit(lambda: prefill(prompt), reps=n, warmup=1)  # noqa: B023 - called before the loop moves on
        profiled = []
        for _ in range(2):
            with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
                t = time.perf_counter()
                prefill(prompt)
                profiled.append((time.perf_counter() - t, prof))
        profiled_wall, prof = min(profiled, key=lambda p: p[0])
        split = categorize_prefill(prof.events())
        wall_ms, total = min(walls) * 1e3, sum(split.values()) or 1.0
        res[title] = dict(step_ms=wall_ms, median_ms=statistics.median(walls) * 1e3,
                          profiled_step_ms=profiled_wall * 1e3, **{k: wall_ms * v / total for k, v in split.items()})
    return res


def print_table(results: dict[str, dict[str, Any]], log: Callable[..., None]) -> None:
    """results: engine -> profile_decode's or profile_prefill's result. One markdown row per engine and batch."""
    first = next((r for scenarios in results.values() for r in scenarios.values()), {})
    categories = PREFILL_CATEGORIES if "Python" in first else CATEGORIES
    log("| engine | batch | ms | " + " | ".join(categories) + " |")
    log("|---|---|---:|" + "---:|" * len(categories))
    for engine, scenarios in results.items():
        for title, r in scenarios.items():
            log(f"| {engine} | {title} | {r['step_ms']:.1f} | "
                + " | ".join(f"{r[c]:.1f} ({100 * r[c] / r['step_ms']:.0f}%)" for c in categories) + " |")
