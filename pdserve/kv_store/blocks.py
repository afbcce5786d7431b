"""Blocks between an engine's KV cache and the stored layout (pdserve's block: `[layers, 2, kv_heads, block_size,
head_dim]`, a block's layers one after another).

pdserve's pool is that layout already: a block is copied as it lies. vLLM-CPU keeps a tensor per layer with the
keys dimension-major; its blocks are regrouped into the stored layout when written and out of it when read
(`kv_transfer/layouts.py`, which the mixed transfers between the two engines use).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from pdserve.kv_store.keys import Namespace
from pdserve.kv_transfer.layouts import Regrouper, pdserve_layout, vllm_cpu_layout


class BlockIO(ABC):
    @abstractmethod
    def read(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks in the stored layout, as `[len(block_ids), block_bytes]` bytes."""

    @abstractmethod
    def write(self, block_ids: list[int], values: Sequence[memoryview]) -> None:
        """Each value (a stored block's bytes) into the cache block of the same place in `block_ids`."""


def _fill(rows: torch.Tensor, values: Sequence[memoryview]) -> None:
    """Stored bytes into `[n, block_bytes]` byte rows (read-only buffers, so through numpy, not torch)."""
    target = rows.numpy()
    for i, value in enumerate(values):
        target[i] = np.frombuffer(value, dtype=np.uint8)


class PoolBlocks(BlockIO):
    """pdserve's pool, `[num_blocks, layers, 2, kv_heads, block_size, head_dim]`."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool
        self._bytes = pool.view(pool.shape[0], -1).view(torch.uint8)

    def read(self, block_ids: list[int]) -> torch.Tensor:
        return self._bytes.index_select(0, torch.tensor(block_ids, dtype=torch.long))

    def write(self, block_ids: list[int], values: Sequence[memoryview]) -> None:
        for block_id, value in zip(block_ids, values, strict=True):
            _fill(self._bytes[block_id:block_id + 1], [value])


class VllmCpuBlocks(BlockIO):
    """vLLM-CPU's caches, one `[num_blocks, kv_heads, block_size * 2 * head_dim]`-shaped tensor per layer."""

    def __init__(self, caches: Sequence[torch.Tensor], namespace: Namespace) -> None:
        self.caches = tuple(caches)
        ns = namespace
        local = vllm_cpu_layout(self.caches, ns.block_size, ns.model)
        stored = pdserve_layout(ns.block_size, ns.num_layers, ns.kv_heads, ns.head_dim, self.caches[0].dtype,
                                ns.model)
        self._regroup = Regrouper(local=local, remote=stored)

    def read(self, block_ids: list[int]) -> torch.Tensor:
        staging, _ = self._regroup.ungroup(self.caches, block_ids, None)
        return staging.view(len(block_ids), -1)

    def write(self, block_ids: list[int], values: Sequence[memoryview]) -> None:
        staging, _ = self._regroup.staging(len(block_ids))
        _fill(staging.view(len(block_ids), -1), values)
        self._regroup.regroup(staging, self.caches, block_ids)


def check_geometry(namespace: Namespace, block_bytes: int, num_layers: int) -> None:
    """The cache must hold blocks of the namespace's size, or nothing stored could be read into it."""
    if block_bytes != namespace.block_bytes or num_layers != namespace.num_layers:
        raise ValueError(f"the KV cache's blocks ({num_layers} layers, {block_bytes} bytes) are not the store "
                         f"namespace's ({namespace.num_layers} layers, {namespace.block_bytes} bytes)")
