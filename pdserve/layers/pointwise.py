"""The row-wise ops of a decoder layer (RMSNorm, the residual add before it, SiLU * mul, rotary embedding with the
KV cache write after it) in plain torch, and the seam through which an engine swaps in fused versions of them
(pdserve.native) without the model knowing which."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.layers.attention import AttentionMetadata, write_kv
from pdserve.layers.rotary import apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm computed in fp32 and cast back, exactly as Hugging Face Llama does."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(input_dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the norm's input and the residual stream's next value."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, layer_cache: torch.Tensor,
                     meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated by their positions, after k (rotated) and v are written to this step's cache slots. The
    fused version rotates q and k in place, so callers pass tensors they own (a projection's fresh output)."""
    q, k = apply_rotary(positions, q, k, cos, sin)
    write_kv(layer_cache, k, v, meta)
    return q, k


# (positions, q, k, v, cos table, sin table, one layer's cache view, metadata) -> (rotated q, rotated k)
RotaryAndCache = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, AttentionMetadata], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class PointwiseOps:
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    rotary_and_cache: RotaryAndCache


TORCH_POINTWISE = PointwiseOps(rms_norm, add_rms_norm, silu_and_mul, rotary_and_cache)


@dataclass(frozen=True, slots=True)
class RMSNorm:
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor, ops: PointwiseOps = TORCH_POINTWISE) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def with_residual(self, x: torch.Tensor, residual: torch.Tensor | None,
                      ops: PointwiseOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm of x + residual, x + residual); the first layer has no residual yet and norms x alone."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps), x
        return ops.add_rms_norm(x, residual, self.weight, self.eps)
