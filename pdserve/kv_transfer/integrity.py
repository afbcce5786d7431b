"""Per-block checksums of transferred KV: corruption is detected (and recomputed or refused), never decoded.

xxh3-64 per block measured 17.5 GB/s here against 3.6 for crc32 (docs/decisions.md); per block rather than
per transfer so that a partial failure keeps its valid prefix.
"""

from __future__ import annotations

import torch
import xxhash

from pdserve.kv_transfer.data_plane.base import byte_view


def block_checksums(kv: torch.Tensor, block_ids: list[int]) -> list[int]:
    data = byte_view(kv)
    size = kv[0].numel() * kv.element_size()
    return [xxhash.xxh3_64_intdigest(data[b * size:(b + 1) * size]) for b in block_ids]


def invalid_blocks(kv: torch.Tensor, block_ids: list[int], expected: list[int]) -> list[int]:
    """The blocks (local ids) whose contents do not match what the sender checksummed."""
    if len(expected) != len(block_ids):
        return list(block_ids)  # no usable checksums: trust nothing
    return [b for b, got, want in zip(block_ids, block_checksums(kv, block_ids), expected, strict=True) if got != want]
