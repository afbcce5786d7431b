"""The row-wise ops of a decoder layer (RMSNorm, the residual add before it, SiLU * mul) in plain torch, and the
seam through which an engine swaps in fused versions of them (pdserve.native) without the model knowing which."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


@dataclass(frozen=True, slots=True)
class PointwiseOps:
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]


TORCH_POINTWISE = PointwiseOps(rms_norm, add_rms_norm, silu_and_mul)


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
