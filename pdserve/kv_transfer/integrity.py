"""Per-block checksums of transferred KV: corruption is detected (and recomputed or refused), never decoded.

xxh3-64 per block measured 17.5 GB/s here against 3.6 for crc32 (docs/decisions.md); per block rather than
per transfer so that a partial failure keeps its valid prefix.
"""

from __future__ import annotations

import xxhash

from pdserve.kv_transfer.data_plane.regions import BlockRegions


def _checksum(regions: BlockRegions, block: int) -> int:
    """One digest over the block's bytes in layer order, whether they lie in one span or one per layer."""
    h = xxhash.xxh3_64()
    for view in regions.block_views(block):
        h.update(view)
    return h.intdigest()


def block_checksums(regions: BlockRegions, block_ids: list[int]) -> list[int]:
    return [_checksum(regions, b) for b in block_ids]


def invalid_blocks(regions: BlockRegions, block_ids: list[int], expected: list[int]) -> list[int]:
    """The blocks (local ids) whose contents do not match what the sender checksummed."""
    if len(expected) != len(block_ids):
        return list(block_ids)  # no usable checksums: trust nothing
    return [b for b, got, want in zip(block_ids, block_checksums(regions, block_ids), expected, strict=True) if got != want]
