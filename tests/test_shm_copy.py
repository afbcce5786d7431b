"""The shm peer's block copies on real memfd-backed pools: scattered ids, whole blocks and single layers, bounds.

End-to-end tests cannot see a short copy (the checksums catch it and the policy recomputes), so the copy itself
is checked here block by block.
"""

from __future__ import annotations

import mmap
import os
import random
import subprocess
import sys
import textwrap

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
    _, remote = memfd_pool(0.0)
    _, local = memfd_pool(0.5)
    peer = ShmPeer(remote, local)
    yield peer, remote, local
    peer.close()


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


# Two shm data planes in one process, as P and D would be; a thread keeps reading while the channel is closed
# (what the agent does when another load from that peer fails). Run in a child: a use-after-unmap kills it.
_CLOSE_DURING_COPY = textwrap.dedent("""
    import threading, random, torch
    from pdserve.kv_transfer.data_plane.base import DataPlaneError
    from pdserve.kv_transfer.data_plane.shm import ShmDataPlane
    shape = (2048, 4, 2, 2, 16, 64)  # 128 MiB of 64 KiB blocks
    owner, reader = ShmDataPlane(), ShmDataPlane()
    owner.allocate(shape, torch.float32).fill_(1.0)
    reader.allocate(shape, torch.float32)
    owner.start(lambda *a: True)
    channel = reader.connect(owner.local_info())
    started, outcome = threading.Event(), []

    def copy():
        rng = random.Random(0)
        try:
            for _ in range(200):
                ids = rng.sample(range(2048), 1024)
                started.set()
                channel.read_blocks("k", "t", ids, ids)
        except DataPlaneError:
            outcome.append("refused after close")

    thread = threading.Thread(target=copy)
    thread.start()
    started.wait(10)
    channel.close()
    thread.join(60)
    owner.stop()
    print(outcome)
""")


def test_closing_a_channel_during_a_copy_does_not_crash():
    run = subprocess.run([sys.executable, "-c", _CLOSE_DURING_COPY], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"child died with {run.returncode}: {run.stderr[-2000:]}"
    assert "refused after close" in run.stdout

