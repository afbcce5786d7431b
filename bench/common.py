"""Shared helpers for pdserve benchmarks: timing, a hardware probe, the model's shape, and the roofline.

The roofline follows ../shared/docs/reference/engine-anchor.md (section 2.3): each forward step takes at least
max(FLOPs / GEMM peak, bytes / DRAM bandwidth), where bytes = every weight except the embedding table (it is
only gathered row by row) plus the KV cache read, and FLOPs = 2 x (linear params) per token + lm_head on the
rows that sample + attention (4 x heads x head_dim x visible context per token per layer). Peak and bandwidth
are measured in the same run (best of several reps), so the bound is an optimistic one.

Import torch only after the caller has set OMP_NUM_THREADS (see engine.py).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

GiB = 1 << 30


# ----------------------------------------------------------------------------- timing


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def timeit(fn: Callable[[], Any], reps: int = 5, warmup: int = 1) -> list[float]:
    """Seconds per call of `fn`, `reps` times after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


@dataclass(slots=True)
class Summary:
    """min / median / max of a sample (any unit)."""

    n: int
    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            return cls(0, float("nan"), float("nan"), float("nan"))
        return cls(len(values), min(values), statistics.median(values), max(values))

    def fmt(self, spec: str = ".1f") -> str:
        if self.n <= 1:
            return format(self.median, spec)
        return f"{self.median:{spec}} ({self.min:{spec}}-{self.max:{spec}})"


class CpuMeter:
    """How many cores other processes (and the hypervisor, as steal) used since the last mark.

    Two torch threads on a 2-core box collapse when anything else runs: each parallel region waits at its
    barrier for a descheduled thread, so a step can get 10-30x slower. Benchmarks record this next to every
    repetition, and can wait for a quiet machine before measuring."""

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._mark = self._read()

    def _read(self) -> tuple[float, float, float, float]:
        try:
            f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            f = [0] * 8
        busy = sum(f[i] for i in (0, 1, 2, 5, 6) if i < len(f)) / self.tick  # user nice system irq softirq
        steal = (f[7] if len(f) > 7 else 0) / self.tick
        t = os.times()
        own = t.user + t.system  # all threads of this process
        return time.monotonic(), busy, steal, own

    def mark(self) -> None:
        self._mark = self._read()

    def since_mark(self) -> dict[str, float]:
        """{'others': cores busy with other processes, 'steal': cores taken by the hypervisor} since mark()."""
        t0, busy0, steal0, own0 = self._mark
        t1, busy1, steal1, own1 = self._read()
        dt = max(t1 - t0, 1e-9)
        return dict(others=max((busy1 - busy0) - (own1 - own0), 0.0) / dt, steal=(steal1 - steal0) / dt)

    def wait_for_quiet(self, max_wait_s: float, threshold: float = 0.25, window_s: float = 1.0) -> float:
        """Block until other processes use < threshold cores over a window, or max_wait_s passes; returns wait s."""
        start = time.monotonic()
        while time.monotonic() - start < max_wait_s:
            self.mark()
            time.sleep(window_s)
            if self.since_mark()["others"] < threshold:
                break
        return time.monotonic() - start


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ----------------------------------------------------------------------------- hardware probe


@dataclass(slots=True)
class Hardware:
    threads: int
    cpu: str
    cpu_capability: str
    avx512_bf16: bool
    amx: bool
    copy_GBps_best: float  # dst.copy_(src), read + write counted
    copy_GBps_median: float
    matmul_fp32_GFLOPs_best: float
    matmul_fp32_GFLOPs_median: float
    matmul_bf16_GFLOPs_best: float
    matmul_bf16_GFLOPs_median: float
    copy_bytes: int
    matmul_n: int
    load_before: str
    load_after: str

    @property
    def bandwidth(self) -> float:
        """Bytes/s used for the roofline (best copy rate: an optimistic bound)."""
        return self.copy_GBps_best * 1e9

    def peak_flops(self, dtype: torch.dtype) -> float:
        """FLOP/s used for the roofline (best large-matmul rate in that dtype)."""
        gflops = self.matmul_bf16_GFLOPs_best if dtype == torch.bfloat16 else self.matmul_fp32_GFLOPs_best
        return gflops * 1e9

    def describe(self) -> str:
        return (f"{self.cpu} | torch {torch.__version__}, {self.cpu_capability}, avx512_bf16={self.avx512_bf16}, "
                f"amx={self.amx} | {self.threads} threads\n"
                f"  memory copy {self.copy_bytes / GiB:.2f} GiB fp32 (read+write): best {self.copy_GBps_best:.1f} / "
                f"median {self.copy_GBps_median:.1f} GB/s\n"
                f"  matmul {self.matmul_n}^3: fp32 best {self.matmul_fp32_GFLOPs_best:.0f} / median "
                f"{self.matmul_fp32_GFLOPs_median:.0f} GFLOP/s; bf16 best {self.matmul_bf16_GFLOPs_best:.0f} / median "
                f"{self.matmul_bf16_GFLOPs_median:.0f} GFLOP/s\n"
                f"  load average {self.load_before} -> {self.load_after}")


def _cpu_info() -> tuple[str, set[str]]:
    name, flags = platform.processor() or "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("?", "", "x86_64"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return name, flags


def probe_hardware(threads: int, copy_bytes: int = GiB, matmul_n: int = 2048, rounds: int = 3, reps: int = 2,
                   pause_s: float = 0.5) -> Hardware:
    """Memory bandwidth (a large fp32 copy) and GEMM peak (fp32, bf16) at `threads` torch threads.

    Samples are taken in `rounds` spread over a few seconds (copy, fp32 matmul, bf16 matmul, pause), so one
    stall of the shared host cannot spoil them all; the best sample is what the roofline uses."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    load_before = loadavg()
    copy: list[float] = []
    rates: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
    try:
        src = torch.randn(copy_bytes // 4)
        dst = torch.empty_like(src)
        mats = {dt: (torch.randn(matmul_n, matmul_n).to(dt), torch.randn(matmul_n, matmul_n).to(dt)) for dt in rates}
        for r in range(rounds):
            copy += [2 * copy_bytes / t / 1e9 for t in timeit(lambda: dst.copy_(src), reps=reps, warmup=1)]
            for dt, (a, b) in mats.items():
                rates[dt] += [2 * matmul_n ** 3 / t / 1e9 for t in timeit(lambda: a @ b, reps=reps, warmup=1)]
            if r + 1 < rounds:
                time.sleep(pause_s)
        del src, dst, mats
    finally:
        torch.set_num_threads(previous)
    name, flags = _cpu_info()
    return Hardware(
        threads=threads, cpu=name, cpu_capability=torch.backends.cpu.get_cpu_capability(),
        avx512_bf16="avx512_bf16" in flags, amx="amx_bf16" in flags,
        copy_GBps_best=max(copy), copy_GBps_median=statistics.median(copy),
        matmul_fp32_GFLOPs_best=max(rates[torch.float32]), matmul_fp32_GFLOPs_median=statistics.median(rates[torch.float32]),
        matmul_bf16_GFLOPs_best=max(rates[torch.bfloat16]),
        matmul_bf16_GFLOPs_median=statistics.median(rates[torch.bfloat16]),
        copy_bytes=copy_bytes, matmul_n=matmul_n, load_before=load_before, load_after=loadavg())


def best_of(a: Hardware, b: Hardware) -> Hardware:
    """Two probes of one machine combined: best of the bests (the roofline's inputs), mean of the medians."""
    return Hardware(
        threads=a.threads, cpu=a.cpu, cpu_capability=a.cpu_capability, avx512_bf16=a.avx512_bf16, amx=a.amx,
        copy_GBps_best=max(a.copy_GBps_best, b.copy_GBps_best),
        copy_GBps_median=(a.copy_GBps_median + b.copy_GBps_median) / 2,
        matmul_fp32_GFLOPs_best=max(a.matmul_fp32_GFLOPs_best, b.matmul_fp32_GFLOPs_best),
        matmul_fp32_GFLOPs_median=(a.matmul_fp32_GFLOPs_median + b.matmul_fp32_GFLOPs_median) / 2,
        matmul_bf16_GFLOPs_best=max(a.matmul_bf16_GFLOPs_best, b.matmul_bf16_GFLOPs_best),
        matmul_bf16_GFLOPs_median=(a.matmul_bf16_GFLOPs_median + b.matmul_bf16_GFLOPs_median) / 2,
        copy_bytes=a.copy_bytes, matmul_n=a.matmul_n, load_before=a.load_before, load_after=b.load_after)


# ----------------------------------------------------------------------------- model shape


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the roofline needs from a decoder-only checkpoint's config.json."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelShape:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        cfg = raw.get("text_config", raw)
        heads = cfg["num_attention_heads"]
        return cls(hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"], layers=cfg["num_hidden_layers"],
                   heads=heads, kv_heads=cfg.get("num_key_value_heads", heads),
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab=cfg["vocab_size"])

    @property
    def layer_linear_params(self) -> int:
        h, hd = self.hidden, self.head_dim
        qkv = h * (self.heads + 2 * self.kv_heads) * hd
        o = self.heads * hd * h
        mlp = 3 * self.intermediate * h  # gate, up, down
        return qkv + o + mlp

    @property
    def linear_params(self) -> int:
        return self.layers * self.layer_linear_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def norm_params(self) -> int:
        return (2 * self.layers + 1) * self.hidden

    @property
    def total_params(self) -> int:
        """Embedding + layers + norms + an untied lm_head (what llama presets have)."""
        return self.lm_head_params * 2 + self.linear_params + self.norm_params

    @property
    def streamed_params(self) -> int:
        """Weights read in full by every forward step: everything except the embedding table."""
        return self.linear_params + self.lm_head_params + self.norm_params

    def kv_bytes_per_token(self, elem: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * elem


# ----------------------------------------------------------------------------- roofline


@dataclass(slots=True)
class StepBound:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def limit(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


class Roofline:
    """Lower bounds on step times for one model, dtype and machine."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype, hw: Hardware) -> None:
        self.shape = shape
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.peak = hw.peak_flops(dtype)
        self.bandwidth = hw.bandwidth

    def step(self, new_tokens: int, sampled_rows: int, attended_keys: float, kv_read_tokens: float) -> StepBound:
        """One forward step.

        new_tokens: tokens through the layers; sampled_rows: rows through lm_head; attended_keys: sum over new
        tokens of the keys each attends to; kv_read_tokens: cached tokens whose K/V are read from memory.
        """
        s = self.shape
        flops = (2 * s.linear_params * new_tokens + 2 * s.lm_head_params * sampled_rows
                 + 4 * s.layers * s.heads * s.head_dim * attended_keys)
        nbytes = s.streamed_params * self.elem + kv_read_tokens * s.kv_bytes_per_token(self.elem)
        return StepBound(flops, nbytes, flops / self.peak, nbytes / self.bandwidth)

    def prefill(self, num_seqs: int, prompt_len: int) -> StepBound:
        """All prompts in one step (no cached context), causal attention, one sampled row each."""
        return self.step(num_seqs * prompt_len, num_seqs, num_seqs * prompt_len * (prompt_len + 1) / 2, 0)

    def decode(self, batch: int, context: int) -> StepBound:
        """One decode step: each sequence feeds one token and attends to `context` keys (including its own)."""
        return self.step(batch, batch, batch * context, batch * (context - 1))

    def generation(self, num_seqs: int, prompt_len: int, new_tokens: int) -> dict[str, Any]:
        """Prefill, then new_tokens - 1 decode steps (the first token comes from prefill)."""
        pre = self.prefill(num_seqs, prompt_len)
        decode_steps = [self.decode(num_seqs, prompt_len + k) for k in range(1, new_tokens)]
        decode_s = sum(d.seconds for d in decode_steps)
        mid = decode_steps[len(decode_steps) // 2] if decode_steps else None
        total = pre.seconds + decode_s
        return dict(
            prefill_s=pre.seconds, prefill_limit=pre.limit, decode_s=decode_s, total_s=total,
            out_tok_s=num_seqs * new_tokens / total,
            decode_step_ms=decode_s / max(len(decode_steps), 1) * 1e3,
            decode_limit=mid.limit if mid else "-",
            decode_mid_compute_ms=mid.compute_s * 1e3 if mid else 0.0,
            decode_mid_memory_ms=mid.memory_s * 1e3 if mid else 0.0,
        )


def to_jsonable(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return {k: to_jsonable(v) for k, v in asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return None
    return obj


def peak_rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def env_threads_note() -> str:
    return f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}, torch threads {torch.get_num_threads()}"
