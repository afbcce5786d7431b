"""Linear layers whose weights are prepared once for the fastest kernel the device has.

On CPU, oneDNN with weights reordered ahead of time is 2x faster than ``F.linear`` for the skinny GEMMs of
batched decode and reaches DRAM bandwidth for batch-1 GEMV (measured in docs/decisions.md). Elsewhere, and when
oneDNN is missing, the plain ``F.linear`` path is used.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


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


def onednn_available(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear:
    """y = x @ W^T + b with W prepared for the device's best kernel. Not an nn.Module: weights never train."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, use_onednn: bool | None = None) -> None:
        self.bias = bias
        self.use_onednn = onednn_available(weight.device) if use_onednn is None else use_onednn
        if self.use_onednn:
            # The reordered weight is opaque (blocked layout); the batch-size hint is left open because a
            # serving step's batch size varies, and measured speed does not depend on it.
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        else:
            self.weight = weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

