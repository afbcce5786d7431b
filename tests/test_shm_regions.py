"""The shm plane over a cache laid out as one tensor per layer (vLLM's), between two real processes on this host.

Such a cache is ordinary process memory, so the plane copies it by cross-memory attach. Oracle: the owner, a
separate process, builds the same per-layer tensors as this test from a known pool; scattered blocks (and single
layers) read or written through the plane must land exactly where named and nowhere else. The owner is then
killed: a read fails with a clear error rather than copying anything, and a probe that does not match refuses
the channel (a pid that names some other process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from pdserve.kv_transfer.data_plane.base import DataPlaneError
from pdserve.kv_transfer.data_plane.regions import BlockRegions
from pdserve.kv_transfer.data_plane.shm import ShmDataPlane

BLOCKS, LAYERS = 6, 3

OWNER = textwrap.dedent("""
    import json, sys, torch
    from pdserve.kv_transfer.data_plane.regions import BlockRegions
    from pdserve.kv_transfer.data_plane.shm import ShmDataPlane
    kv = torch.arange(%d, dtype=torch.float32).reshape(%r)
    layers = [kv[:, layer].contiguous() for layer in range(%d)]
    plane = ShmDataPlane()
    plane.attach_regions(BlockRegions.from_layers(layers))
    plane.start(lambda op, key, token, ids: None)
    print(json.dumps(plane.local_info()), flush=True)
    for line in sys.stdin:  # "dump": the owner's blocks as they are now, after a peer's writes
        print(json.dumps([t.tolist() for t in layers]), flush=True)
""")
SHAPE = (BLOCKS, LAYERS, 2, 2, 4, 8)


def per_layer() -> list[torch.Tensor]:
    kv = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE)
    return [kv[:, layer].contiguous() for layer in range(LAYERS)]


@pytest.fixture
def owner():
    script = OWNER % (torch.Size(SHAPE).numel(), SHAPE, LAYERS)
    process = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    info = json.loads(process.stdout.readline())
    yield process, info
    process.kill()
    process.wait(10)


def reader(target: list[torch.Tensor]) -> ShmDataPlane:
    plane = ShmDataPlane()
    plane.attach_regions(BlockRegions.from_layers(target))
    return plane


def test_reads_scattered_blocks_of_another_process_per_layer_cache(owner):
    process, info = owner
    source = per_layer()
    target = [torch.zeros_like(t) for t in source]
    channel = reader(target).connect(info)
    # 1-2 adjacent in both, then a lone pair: merged runs and single blocks.
    nbytes = channel.read_blocks("k", "t", [4, 1, 2], [0, 2, 3])
    assert nbytes == 3 * LAYERS * source[0][0].numel() * 4
    for layer in range(LAYERS):
        for remote, local in ((4, 0), (1, 2), (2, 3)):
            assert torch.equal(target[layer][local], source[layer][remote])
        assert not target[layer][[1, 4, 5]].any()  # nothing else was written


def test_writes_a_single_layer_into_another_process(owner):
    process, info = owner
    local = [torch.full_like(t, -1.0) for t in per_layer()]
    channel = reader(local).connect(info)
    channel.write_blocks("k", "t", [0, 1], [5, 3], layer=1)
    process.stdin.write("dump\n")
    process.stdin.flush()
    after = [torch.tensor(t) for t in json.loads(process.stdout.readline())]
    expected = per_layer()
    expected[1][5] = -1.0
    expected[1][3] = -1.0
    for layer in range(LAYERS):
        assert torch.equal(after[layer], expected[layer]), layer


def test_a_dead_owner_fails_the_read_and_a_wrong_probe_refuses_the_channel(owner):
    process, info = owner
    target = [torch.zeros_like(t) for t in per_layer()]
    plane = reader(target)
    forged = {**info, "cma": {**info["cma"], "probe": {**info["cma"]["probe"], "nonce": "00" * 16}}}
    with pytest.raises(DataPlaneError, match="probe differs"):
        plane.connect(forged)
    channel = plane.connect(info)
    process.kill()
    process.wait(10)
    with pytest.raises(DataPlaneError, match="process is gone"):
        channel.read_blocks("k", "t", [0], [0])
    assert not any(t.any() for t in target)
