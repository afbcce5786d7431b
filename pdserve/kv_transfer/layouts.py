"""Whose layout a peer's KV blocks are in, and regrouping them into this instance's cache when it is another.

Bytes move opaquely between instances whose compatibility hashes match. A pdserve instance and a vLLM-CPU
instance running PdConnector hold the same model's KV laid out differently (pdserve: a block is ``[layers, 2,
heads, block_size, head_dim]``; vLLM-CPU: a tensor per layer, per block and head the keys dimension-major, then
the values), so each says in the handshake what its blocks are (`KVLayout`), and a reader meeting the other
layout reads the writer's blocks into a staging area, checks their checksums there (they are the writer's
bytes) and regroups them into its own cache (`vllm_nixl/layout.py`, which the NIXL interop uses too). Any other
difference (model, dtype, block size, geometry, an unknown layout) is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.data_plane.regions import BlockRegions
from pdserve.kv_transfer.messages import KVLayout
from pdserve.kv_transfer.vllm_nixl.layout import gather_into_mirror, mirror_view, scatter_into_pool, staging_view

PDSERVE = "pdserve"
VLLM_CPU = "vllm-cpu"
# How each known engine stores a block's keys; a layout claiming another is not one this code regroups.
KEY_LAYOUTS = {PDSERVE: "token-major", VLLM_CPU: "dim-major"}


def pdserve_layout(block_size: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                   model: str) -> KVLayout:
    return KVLayout(engine=PDSERVE, key_layout=KEY_LAYOUTS[PDSERVE], block_size=block_size,
                    layer_shape=[2, kv_heads, block_size, head_dim], dtype=str(dtype), num_layers=num_layers,
                    model=model)


def vllm_cpu_layout(caches: Sequence[torch.Tensor], block_size: int, model: str) -> KVLayout:
    """vLLM-CPU's caches, one ``[blocks, kv_heads, block_size, 2 * head_dim]`` tensor per layer."""
    first = caches[0]
    return KVLayout(engine=VLLM_CPU, key_layout=KEY_LAYOUTS[VLLM_CPU], block_size=block_size,
                    layer_shape=list(first.shape[1:]), dtype=str(first.dtype), num_layers=len(caches), model=model)


def _geometry(layout: KVLayout) -> tuple[int, int] | None:
    """(kv_heads, head_dim) of a known layout whose per-layer block shape is what its engine writes."""
    shape = layout.layer_shape
    if layout.engine == PDSERVE and len(shape) == 4 and shape[0] == 2 and shape[2] == layout.block_size:
        return shape[1], shape[3]
    if layout.engine == VLLM_CPU and len(shape) == 3 and shape[1] == layout.block_size and shape[2] % 2 == 0:
        return shape[0], shape[2] // 2
    return None


def translation_refused(local: KVLayout | None, remote: KVLayout | None) -> str:
    """Why a reader with `local` cannot regroup blocks laid out as `remote` ("" when it can)."""
    if local is None or remote is None:
        return "the peer does not describe its KV layout"
    for layout in (local, remote):
        if KEY_LAYOUTS.get(layout.engine) != layout.key_layout or _geometry(layout) is None:
            return f"unknown KV layout {layout.engine} (keys {layout.key_layout}, layer block {layout.layer_shape})"
    if local.engine == remote.engine:
        return f"both are {local.engine} layouts, yet their compatibility hashes differ"
    if not local.model or local.model != remote.model:
        return "the two instances serve different model weights (or one cannot fingerprint them)"
    for what, mine, theirs in (("block size", local.block_size, remote.block_size),
                               ("dtype", local.dtype, remote.dtype), ("layer count", local.num_layers,
                                                                      remote.num_layers),
                               ("(kv_heads, head_dim)", _geometry(local), _geometry(remote))):
        if mine != theirs:
            return f"{what} {mine} here, {theirs} at the peer"
    return ""


@dataclass(frozen=True, slots=True)
class Regrouper:
    """Transfers with a peer whose blocks are in another known layout, through a staging area in the peer's
    layout: reads land there and are regrouped into the local cache; writes are regrouped there from it."""

    local: KVLayout
    remote: KVLayout

    def staging(self, num_blocks: int) -> tuple[torch.Tensor, BlockRegions]:
        """Room for `num_blocks` of the peer's blocks, each its layers' bytes in order, as a socket sends them."""
        layer_bytes = torch.Size(self.remote.layer_shape).numel() * _dtype(self.remote).itemsize
        staging = torch.empty(num_blocks, self.remote.num_layers, layer_bytes, dtype=torch.uint8)
        return staging, BlockRegions.from_pool(staging)

    def regroup(self, staging: torch.Tensor, caches: Sequence[torch.Tensor], local_ids: list[int]) -> None:
        """The staged blocks (in `local_ids` order) into the local cache: pdserve's pool as ``(pool,)``, or
        vLLM-CPU's tensor per layer."""
        n, block_size, flat = len(local_ids), self.local.block_size, staging.view(-1)
        if self.local.engine == PDSERVE:
            pool = caches[0]
            staged = staging_view(flat, pool, n, block_size, block_major=True)
            scatter_into_pool(staged, pool, local_ids, 0, n * block_size)
            return
        heads, head_dim = _geometry(self.remote) or (0, 0)
        source = flat.view(_dtype(self.remote)).view(n, self.remote.num_layers, 2, heads, block_size, head_dim)
        layers = [cache.view(cache.shape[0], cache.shape[1], -1) for cache in caches]
        gather_into_mirror(source, list(range(n)), n * block_size, layers, local_ids)


    def ungroup(self, caches: Sequence[torch.Tensor], local_ids: list[int], layer: int | None
                ) -> tuple[torch.Tensor, BlockRegions]:
        """The local blocks (or one layer of each, the others left unset) staged in the peer's layout, as staged
        blocks ``0..n-1`` in `local_ids` order, ready to be written to it: the inverse of `regroup`."""
        n, block_size = len(local_ids), self.local.block_size
        staging, regions = self.staging(n)
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        source_dtype = _dtype(self.local)
        if self.local.engine == PDSERVE:
            pool = caches[0]
            heads = pool.shape[3]
            mirror = [staging[:, index].view(source_dtype).view(n, heads, -1)
                      for index in range(self.remote.num_layers)[layers]]
            gather_into_mirror(pool[:, layers], local_ids, n * block_size, mirror, list(range(n)))
            return staging, regions
        heads, head_dim = _geometry(self.remote) or (0, 0)
        pool = staging.view(source_dtype).view(n, self.remote.num_layers, 2, heads, block_size, head_dim)
        ids = torch.tensor(local_ids, dtype=torch.long)
        parts = [mirror_view(cache.view(cache.shape[0], cache.shape[1], -1), block_size) for cache in caches[layers]]
        staged = tuple(torch.stack([part[side][ids] for part in parts]) for side in (0, 1))
        scatter_into_pool(staged, pool[:, layers], list(range(n)), 0, n * block_size)
        return staging, regions


def _dtype(layout: KVLayout) -> torch.dtype:
    return getattr(torch, layout.dtype.removeprefix("torch."))
