"""The shm peer's block copies on real memfd-backed pools: scattered ids, whole blocks and single layers, bounds.

End-to-end tests cannot see a short copy (the checksums catch it and the policy recomputes), so the copy itself
is checked here block by block.
"""

from __future__ import annotations

import mmap
import os
import random

import pytest
import torch

from pdserve.kv_transfer.data_plane.base import DataPlaneError
from pdserve.kv_transfer.data_plane.shm import ShmPeer, map_pool

SHAPE = [256, 3, 2, 2, 16, 64]  # blocks, layers, K/V, kv heads, block size, head dim: 48 KiB blocks


def memfd_pool(fill: float) -> tuple[mmap.mmap, torch.Tensor]:
    fd = os.memfd_create("pdserve-test")
    try:
        os.ftruncate(fd, torch.Size(SHAPE).numel() * 4)
        mapping, pool = map_pool(fd, SHAPE, torch.float32)
    finally:
        os.close(fd)
    pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(SHAPE) + fill)
    return mapping, pool


@pytest.fixture
def pools():
    remote_map, remote = memfd_pool(0.0)
    local_map, local = memfd_pool(0.5)
    peer = ShmPeer(remote_map, remote, local)
    yield peer, remote, local
    del remote, local
    peer.close()
    local_map.close()


def scattered(n: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return rng.sample(range(SHAPE[0]), n), rng.sample(range(SHAPE[0]), n)


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_read_scattered_blocks_copies_exactly_those(pools, threads):
    peer, remote, local = pools
    assert peer.raw  # contiguous CPU pools of one layout take the memmove path
    before = local.clone()
    rng = random.Random(0)
    # 120 scattered pairs (one memmove each) plus a run of 30 consecutive blocks on both sides (1.4 MiB: one
    # torch copy, which uses every thread), all ids distinct
    remote_ids = rng.sample(range(200), 120) + list(range(200, 230))
    local_ids = rng.sample(range(30, 256), 120) + list(range(0, 30))
    moved = peer.read_blocks("k", "t", remote_ids, local_ids)
    assert moved == 150 * local[0].numel() * 4
    for r, dst in zip(remote_ids, local_ids):
        assert torch.equal(local[dst], remote[r])
    untouched = sorted(set(range(SHAPE[0])) - set(local_ids))
    assert torch.equal(local[untouched], before[untouched])


def test_write_whole_blocks_and_single_layers(pools, threads):
    peer, remote, local = pools
    before = remote.clone()
    local_ids, remote_ids = scattered(6, 1)
    peer.write_blocks("k", "t", local_ids, remote_ids)
    for src, dst in zip(local_ids, remote_ids):
        assert torch.equal(remote[dst], local[src])
    local_ids, remote_ids = scattered(5, 2)
    remote.copy_(before)
    peer.write_blocks("k", "t", local_ids, remote_ids, layer=1)
    for src, dst in zip(local_ids, remote_ids):
        assert torch.equal(remote[dst, 1], local[src, 1])
        assert torch.equal(remote[dst, 0], before[dst, 0]) and torch.equal(remote[dst, 2], before[dst, 2])


@pytest.mark.parametrize("bad", [-1, SHAPE[0], 10**9])
def test_out_of_range_ids_are_refused_before_any_copy(pools, bad):
    peer, remote, local = pools
    before = local.clone()
    with pytest.raises(DataPlaneError):
        peer.read_blocks("k", "t", [1, bad], [2, 3])
    with pytest.raises(DataPlaneError):
        peer.read_blocks("k", "t", [1, 2], [3, bad])
    with pytest.raises(DataPlaneError):
        peer.write_blocks("k", "t", [1, 2], [bad, 3])
    assert torch.equal(local, before)
