"""Per-block checksums of transferred KV: corruption is detected (and recomputed or refused), never decoded.

xxh3-64 per block measured 17.5 GB/s here against 3.6 for crc32 (docs/decisions.md); per block rather than
per transfer so that a partial failure keeps its valid prefix.

KV in device memory (vLLM's on a GPU) is checksummed where it lies, with torch ops: copying every block to the
host for xxh3 would add the transfer's size again in device-to-host traffic at both ends. Per block, its 32-bit
words are weighted by position and summed modulo the prime 2^31 - 1, twice with different weights (62 bits):
a changed word, or two words swapped, changes the sum unless the difference is a multiple of the prime. That is
weaker than xxh3 against crafted bytes, which no checksum here is meant to stop, and catches transit damage (a
lost run of bytes, a stray write). Both ends of a device transfer compute it alike: the compatibility hash
names the device type, so a GPU cache never pairs with a host one.
"""

from __future__ import annotations

import torch
import xxhash

from pdserve.kv_transfer.data_plane.regions import BlockRegions

_PRIME = 2**31 - 1
# A word (below 2^32) times a weight (below 2^31) stays inside int64; position * multiplier does too for any
# block under 2^40 words.
_MULTIPLIERS = (48271, 69621)


def _checksum(regions: BlockRegions, block: int) -> int:
    """One digest over the block's bytes in layer order, whether they lie in one span or one per layer."""
    h = xxhash.xxh3_64()
    for view in regions.block_views(block):
        h.update(view)
    return h.intdigest()


def device_checksums(regions: BlockRegions, block_ids: list[int]) -> list[int]:
    """The position-weighted sums of each block's words, computed with torch ops where the layers lie."""
    layers = regions.device_layers
    device = layers[0].device
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=device)
    words = regions.layer_bytes // 4
    sums = torch.zeros((len(_MULTIPLIERS), len(block_ids)), dtype=torch.int64, device=device)
    for index, layer in enumerate(layers):
        values = layer.index_select(0, ids).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        positions = torch.arange(index * words, (index + 1) * words, dtype=torch.int64, device=device)
        for k, multiplier in enumerate(_MULTIPLIERS):
            weights = positions * multiplier % _PRIME + 1
            sums[k] = (sums[k] + (values * weights % _PRIME).sum(dim=1)) % _PRIME
    return ((sums[0] << 31) | sums[1]).tolist()


def block_checksums(regions: BlockRegions, block_ids: list[int]) -> list[int]:
    if regions.device_layers:
        return device_checksums(regions, block_ids) if block_ids else []
    return [_checksum(regions, b) for b in block_ids]


def invalid_blocks(regions: BlockRegions, block_ids: list[int], expected: list[int]) -> list[int]:
    """The blocks (local ids) whose contents do not match what the sender checksummed."""
    if len(expected) != len(block_ids):
        return list(block_ids)  # no usable checksums: trust nothing
    return [b for b, got, want in zip(block_ids, block_checksums(regions, block_ids), expected, strict=True) if got != want]
