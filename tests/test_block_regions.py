"""The tcp data plane and the checksums serve a KV cache laid out as one tensor per layer (vLLM's) exactly as
pdserve's one-tensor pool: the same blocks' bytes arrive, in the same place, with the same checksums.

Oracle: a per-layer cache is built from a pdserve pool by slicing each layer out; block b's bytes must read back
identically through either description, over a real socket, and damage to one layer is caught by the checksum.
"""

from __future__ import annotations

import torch

from pdserve.kv_transfer.data_plane.regions import BlockRegions
from pdserve.kv_transfer.data_plane.tcp import TcpDataPlane
from pdserve.kv_transfer.integrity import block_checksums, invalid_blocks

BLOCKS, LAYERS = 6, 3


def pool() -> torch.Tensor:
    """pdserve's layout [blocks, layers, 2, heads, block_size, head_dim], filled with distinct values."""
    return torch.arange(BLOCKS * LAYERS * 2 * 2 * 4 * 8, dtype=torch.float32).reshape(BLOCKS, LAYERS, 2, 2, 4, 8)


def per_layer(kv: torch.Tensor) -> list[torch.Tensor]:
    """The same bytes as vLLM lays them out: one contiguous tensor per layer, [blocks, ...]."""
    return [kv[:, layer].contiguous() for layer in range(LAYERS)]


def test_checksums_agree_between_layouts():
    kv = pool()
    assert block_checksums(BlockRegions.from_pool(kv), list(range(BLOCKS))) == \
        block_checksums(BlockRegions.from_layers(per_layer(kv)), list(range(BLOCKS)))


def test_tcp_reads_per_layer_cache_into_per_layer_cache():
    source = per_layer(pool())
    target = [torch.zeros_like(t) for t in source]
    server, client = TcpDataPlane(), TcpDataPlane()
    server.attach_regions(BlockRegions.from_layers(source))
    client.attach_regions(BlockRegions.from_layers(target))
    server.start(lambda op, key, token, ids: None)
    try:
        channel = client.connect(server.local_info())
        nbytes = channel.read_blocks("k", "t", [4, 1, 2], [0, 5, 3])
        channel.close()
    finally:
        server.stop()
    assert nbytes == 3 * LAYERS * source[0][0].numel() * 4
    for layer in range(LAYERS):
        for remote, local in ((4, 0), (1, 5), (2, 3)):
            assert torch.equal(target[layer][local], source[layer][remote])
        assert not target[layer][[1, 2, 4]].any()  # nothing else was written
    regions = BlockRegions.from_layers(target)
    expected = block_checksums(BlockRegions.from_layers(source), [4, 1, 2])
    assert invalid_blocks(regions, [0, 5, 3], expected) == []
    target[2][5].view(-1)[0] += 1.0  # damage one layer of one block
    assert invalid_blocks(regions, [0, 5, 3], expected) == [5]
