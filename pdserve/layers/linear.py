"""Linear layers whose weights are prepared once for the fastest kernel the device has.

On CPU, oneDNN with weights reordered ahead of time is the faster kernel for the skinny GEMMs of batched decode and
for prefill, and for bf16 GEMVs; a single fp32 row goes faster through ``F.linear`` (measured in
docs/decisions.md). Elsewhere, and when oneDNN is missing, the plain ``F.linear`` path is used.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.utils import cpuinfo_line


# oneDNN compiles one primitive per GEMM shape and ideep caches each shape's descriptor, 1024 of each by default at
# ~0.6 MB a pair. A serving step's token count varies from step to step, so every count seen adds entries until
# both caches are full: an instance grew by ~850 MiB in two minutes of mixed load. 64 entries hold the shapes of
# steady decode batches and cost ~3 % more CPU on a mix of batch sizes (measured in docs/decisions.md).
ONEDNN_CACHE_CAPACITY = 64


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap oneDNN's primitive cache and ideep's descriptor cache. Both read their size from the environment at
    their first use, so this runs before the first `Linear` is built; a value the operator set wins."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))


def onednn_available(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN serves linears of `dtype` here. Its packed bf16 and fp16 paths need the CPU's own support
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT for bf16; AVX-512 FP16 or AVX-NE-CONVERT for fp16): without it, as on AVX2
    CPUs (AMD before Zen 4, Intel client parts), reordering the weight raises, and F.linear serves them."""
    if not (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


class Linear:
    """y = x @ W^T + b with W prepared for the device's best kernel. Not an nn.Module: weights never train.

    With oneDNN, inputs of at most `plain_rows` rows still take ``F.linear`` on the plain weight, which is then
    kept beside the packed one; `calibrate_linears` sets it (by default: fp32 single rows, batch-1 decode)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, use_onednn: bool | None = None) -> None:
        self.bias = bias
        self.use_onednn = onednn_available(weight.device, weight.dtype) if use_onednn is None else use_onednn
        self.plain: torch.Tensor | None = weight.contiguous()
        self.packed: torch.Tensor | None = None
        self.plain_rows = 0
        if self.use_onednn:
            # The reordered weight is opaque (blocked layout); the batch-size hint is left open because a
            # serving step's batch size varies, and measured speed does not depend on it.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.plain, None)
            self.plain = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] > self.plain_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.plain, self.bias)


# onednn: packed weights only (the least memory). gemv (default): as onednn, but a single fp32 row takes F.linear
# on a plain copy where MKL serves it well. auto: F.linear wherever calibrate_linears measures it faster.
LINEAR_ENV_VAR = "PDSERVE_LINEAR_BACKEND"
LINEAR_BACKENDS = ("onednn", "gemv", "auto")
CALIBRATION_ROWS = (1, 2, 4, 8, 16)
PLAIN_MARGIN = 0.9  # F.linear must be this much faster to be worth a second copy of the weight


def cpu_vendor() -> str:
    """The x86 vendor string ("GenuineIntel", "AuthenticAMD"), or "" where the kernel does not report one."""
    line = cpuinfo_line("vendor_id")
    return line.split(":", 1)[1].strip() if line else ""


def mkl_gemv_preferred() -> bool:
    """Whether F.linear's single-row fp32 GEMV (MKL's) beats oneDNN's here: on Intel CPUs MKL streams the weights at
    ~30 GB/s against oneDNN's ~24; on AMD, where MKL does not take its tuned paths, it was 2x slower than oneDNN."""
    return torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel"


def calibrate_linears(linears: list[Linear], weights: list[torch.Tensor]) -> None:
    """Decide, per linear, up to how many rows take F.linear beside oneDNN; weights[i] is linears[i]'s plain weight.

    gemv: fp32 single rows where `mkl_gemv_preferred` (batch-1 decode ~15 % faster, measured in docs/decisions.md);
    from two rows up oneDNN is the faster kernel. The rule is fixed per machine, never timed, so every instance on
    a machine decides alike; and one row is where oneDNN's own fp32 rounding already departs from its multi-row
    result (its GEMV, for long rows; 2 to 600 rows agree bit for bit), so rows in batches of two or more round as
    before, whatever the batch. Costs a second copy of the fp32 weights; bf16 is untouched (oneDNN wins there at
    every count).
    auto (opt-in): per weight shape, time both kernels at a few small row counts (a few ms) and keep the plain
    weight for the counts where F.linear wins. The choice depends on the moment's timings, so two instances may
    decide differently; instances that must agree token for token (disaggregated against colocated) keep gemv."""
    backend = os.environ.get(LINEAR_ENV_VAR, "gemv")
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"{LINEAR_ENV_VAR}={backend!r}: expected one of {', '.join(LINEAR_BACKENDS)}")
    gemv_rows = 1 if backend == "gemv" and mkl_gemv_preferred() else 0
    decided: dict[tuple[tuple[int, ...], torch.dtype], int] = {}
    for linear, weight in zip(linears, weights, strict=True):
        if linear.packed is None or backend == "onednn":
            continue
        key = (tuple(weight.shape), weight.dtype)
        if key not in decided:
            if backend == "gemv":
                decided[key] = gemv_rows if weight.dtype == torch.float32 else 0
            else:
                decided[key] = _plain_rows(linear, weight.contiguous())
        if decided[key]:
            linear.plain, linear.plain_rows = weight.contiguous(), decided[key]


def _plain_rows(linear: Linear, weight: torch.Tensor) -> int:
    best = 0
    for rows in CALIBRATION_ROWS:
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        plain = _fastest(lambda: F.linear(x, weight, linear.bias))
        packed = _fastest(lambda: torch.ops.mkldnn._linear_pointwise(x, linear.packed, linear.bias, "none", [], ""))
        if plain > PLAIN_MARGIN * packed:
            break
        best = rows
    return best


def _fastest(fn: Callable[[], object], reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
