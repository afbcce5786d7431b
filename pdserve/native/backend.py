"""Which kernels an engine uses: the native ones (paged decode and prefill attention, fused RMSNorm / residual add /
SiLU * mul, rotary embedding with the cache write) or the plain-torch path. The fused row-wise ops and the prefill
attention come with the decode kernel: one library, one choice. The prefill kernel also needs oneDNN's micro-kernels
for the dtype (bf16: AMX); where they are missing, prefill chunks take SDPA beside the native decode kernel.

`auto` takes the native kernel when its library is already in the build cache and falls back to torch otherwise
(no compiler, a failed build, a device other than the CPU, a dtype the kernel lacks); `native` builds it if needed
and fails startup when it cannot be had; `torch` never loads it. The engine's config names the choice, else
$PDSERVE_ATTENTION_BACKEND, else `auto`.
"""

from __future__ import annotations

import logging
import os

import torch

from pdserve.config import ATTENTION_BACKENDS
from pdserve.layers.attention import AttentionMetadata, DecodeKernel, PrefillKernel
from pdserve.layers.pointwise import TORCH_POINTWISE, PointwiseOps
from pdserve.native.build import cached_library, ensure_built, load_library

log = logging.getLogger(__name__)

ENV_VAR = "PDSERVE_ATTENTION_BACKEND"
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def requested_backend(configured: str | None) -> str:
    choice = configured or os.environ.get(ENV_VAR) or "auto"
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {choice!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    return choice


def native_decode(q: torch.Tensor, layer_cache: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
                  scale: float) -> torch.Tensor:
    return torch.ops.pdserve.paged_decode(q, layer_cache, table, lengths, scale)


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.pdserve.rms_norm(x, weight, eps)


def native_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.pdserve.add_rms_norm(x, residual, weight, eps)


def native_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return torch.ops.pdserve.silu_and_mul(gate_up)


def native_rotary_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, layer_cache: torch.Tensor,
                            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    torch.ops.pdserve.rotary_embedding_and_cache(positions, q, k, v, cos, sin, layer_cache, meta.slot_block,
                                                 meta.slot_offset)
    return q, k


def native_prefill(q: torch.Tensor, layer_cache: torch.Tensor, out: torch.Tensor, spans: torch.Tensor,
                   tables: torch.Tensor, scale: float) -> None:
    torch.ops.pdserve.paged_prefill(q, layer_cache, out, spans, tables, scale)


NATIVE_POINTWISE = PointwiseOps(native_rms_norm, native_add_rms_norm, native_silu_and_mul, native_rotary_and_cache)


def pointwise_ops_for(decode_kernel: DecodeKernel | None) -> PointwiseOps:
    """The fused row-wise ops when the native library is loaded (it holds both), else plain torch."""
    return TORCH_POINTWISE if decode_kernel is None else NATIVE_POINTWISE


def prefill_kernel_for(decode_kernel: DecodeKernel | None, dtype: torch.dtype) -> PrefillKernel | None:
    """The native prefill kernel when the native library is loaded and its micro-kernels serve `dtype` on this CPU,
    else None (SDPA per chunk); says which in the log."""
    if decode_kernel is None:
        return None
    if not torch.ops.pdserve.prefill_supported(dtype):
        log.info("prefill attention: torch (oneDNN's micro-kernels do not serve %s on this CPU)", dtype)
        return None
    log.info("prefill attention: native paged kernel")
    return native_prefill


def choose_decode_kernel(configured: str | None, device: torch.device, dtype: torch.dtype) -> DecodeKernel | None:
    """The native kernel, or None for the torch path; says once, in the log, which one and why."""
    choice = requested_backend(configured)
    kernel, why = _resolve(choice, device, dtype)
    if kernel is None and choice == "native":
        raise RuntimeError(f"--attention-backend native: {why}")
    log.info("decode attention: %s (%s)", "native paged kernel" if kernel else "torch", why)
    return kernel


def _resolve(choice: str, device: torch.device, dtype: torch.dtype) -> tuple[DecodeKernel | None, str]:
    if choice == "torch":
        return None, "asked for"
    if device.type != "cpu" or dtype not in NATIVE_DTYPES:
        return None, f"the native kernel serves fp32 and bf16 on CPU, not {dtype} on {device.type}"
    try:
        path = ensure_built() if choice == "native" else cached_library()
        if not path.exists():
            return None, "the native kernel is not built; `python -m pdserve.native` builds it (make install does)"
        load_library(path)
    except Exception as exc:  # noqa: BLE001 - any build or load failure leaves the torch path, which always works
        return None, f"the native kernel failed to build or load: {exc}"
    return native_decode, f"loaded from {path}"
