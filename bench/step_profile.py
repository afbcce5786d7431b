"""Where one decode step's time goes, for any engine that can be stepped in-process: torch.profiler with Python
stacks around `step()`, every op's self time put in one of linears / lm_head / attention / other ops, and the step's
Python time outside the model's layers (scheduling, batch preparation, output processing) as "outside ops".

Classification by the Python frames an op ran under (with_stack makes every Python call an event, the parent of the
ops it calls): lm_head under the model's compute_logits / logits processor; attention when the innermost source
file is an attention module; linears when the op is a GEMM (or under vLLM's layers/linear.py); other ops; Python
self time elsewhere is "outside ops". Shares are of the profiled time, applied to the unprofiled median step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from harness import timeit

CATEGORIES = ("linears", "lm_head", "attention", "other ops", "outside ops")
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


def categorize(events: Any) -> dict[str, float]:
    """Self CPU microseconds per category over a profile's events, on the thread that ran the steps."""
    per_thread: dict[int, int] = {}  # events per thread; an idle helper thread has few, long ones (a wait)
    for ev in events:
        per_thread[ev.thread] = per_thread.get(ev.thread, 0) + 1
    main = max(per_thread, key=per_thread.__getitem__)
    out = dict.fromkeys(CATEGORIES, 0.0)
    for ev in events:
        if ev.thread != main:
            continue
        chain, parent = [ev.name], ev.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        cls = _frames_class(chain)
        if cls is None:
            python = ".py(" in ev.name or ev.name.startswith("<built-in")  # a Python frame or C call, not an op
            cls = "linears" if ev.name in GEMM_OPS else "outside ops" if python else "other ops"
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


def print_table(results: dict[str, dict[str, Any]], log: Callable[..., None]) -> None:
    """results: engine -> profile_decode's result. One markdown row per engine and batch."""
    log("| engine | batch | step ms | " + " | ".join(CATEGORIES) + " |")
    log("|---|---|---:|" + "---:|" * len(CATEGORIES))
    for engine, scenarios in results.items():
        for title, r in scenarios.items():
            log(f"| {engine} | {title} | {r['step_ms']:.1f} | "
                + " | ".join(f"{r[c]:.1f} ({100 * r[c] / r['step_ms']:.0f}%)" for c in CATEGORIES) + " |")
