"""The planes over a one-sided engine (nixl, mooncake) on their own: an owner process serves its pool, this process
reads and writes runs of blocks and single layers through the engine, checked byte for byte; the owner's capability check refuses what it did not grant,
and an idle owner does not spin a core."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch
from server_utils import data_planes

from pdserve.kv_transfer.data_plane import DATA_PLANES, DataPlaneError, make_data_plane
from pdserve.kv_transfer.data_plane.nixl_agent import memory_kind
from pdserve.kv_transfer.data_plane.regions import BlockRegions

pytestmark = [pytest.mark.parametrize("plane", data_planes("nixl", "mooncake")), pytest.mark.core]

SHAPE = (24, 3, 2, 2, 4, 8)  # blocks, layers, kv, heads, block_size, head_dim
ROOT = Path(__file__).resolve().parent.parent

# The owner: a pool of distinct values, a grant for ("k", "t") on blocks 0..15 only (read) and 16..23 (write).
OWNER = """
import json, sys, torch
from pdserve.kv_transfer.data_plane import make_data_plane
shape = tuple(json.loads(sys.argv[1]))
plane = make_data_plane(sys.argv[2], "127.0.0.1")
pool = plane.allocate(shape, torch.float32)
pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(shape))
def authorize(op, key, token, ids):
    if (key, token) != ("k", "t"):
        return "wrong transfer token" if key == "k" else "no KV is held for this transfer"
    allowed = range(16) if op == "read" else range(16, 24)
    return None if all(b in allowed for b in ids) else "blocks outside the transfer"
plane.start(authorize)
print(json.dumps(plane.local_info()), flush=True)
for line in sys.stdin:  # "dump": the pool's bytes, to check what was written
    sys.stdout.buffer.write(pool.numpy().tobytes()); sys.stdout.buffer.flush()
"""


@pytest.fixture()
def owner(plane):
    if plane not in DATA_PLANES:
        pytest.fail(f"the {plane} data plane's engine is not installed")
    proc = subprocess.Popen([sys.executable, "-c", OWNER, msgspec.json.encode(SHAPE).decode(), plane], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        info = msgspec.json.decode(proc.stdout.readline())
        yield proc, info
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture()
def reader(owner, plane):
    """This process's plane, its (zeroed) pool and a channel to the owner's."""
    plane_here = make_data_plane(plane, "127.0.0.1")
    local = plane_here.allocate(SHAPE, torch.float32)
    channel = plane_here.connect(owner[1])
    try:
        yield local, channel
    finally:
        channel.close()
        plane_here.stop()


def owner_pool(proc) -> torch.Tensor:
    proc.stdin.write(b"dump\n")
    proc.stdin.flush()
    data = proc.stdout.read(torch.Size(SHAPE).numel() * 4)
    return torch.frombuffer(bytearray(data), dtype=torch.float32).view(SHAPE)


def reference() -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE)


def test_reads_and_writes_runs_of_blocks_and_single_layers(owner, reader):
    proc, _ = owner
    local, channel = reader
    # Runs (9, 8, 7 descending; 3..5 ascending) and a lone block, into scattered local blocks.
    remote_ids, local_ids = [9, 8, 7, 3, 4, 5, 12], [20, 19, 18, 0, 1, 2, 11]
    moved = channel.read_blocks("k", "t", remote_ids, local_ids)
    assert moved == len(remote_ids) * local[0].numel() * 4
    for r, b in zip(remote_ids, local_ids):
        assert torch.equal(local[b], reference()[r])
    # Push: whole blocks, then one layer of other blocks, into the owner's pool.
    local.copy_(-torch.arange(local.numel(), dtype=torch.float32).view(SHAPE))
    channel.write_blocks("k", "t", [0, 1, 5], [16, 17, 20])
    assert channel.write_blocks("k", "t", [6, 7, 8], [21, 22, 23], layer=1) == 3 * local[0, 1].numel() * 4
    after, expected = owner_pool(proc), reference()
    for s, d in zip([0, 1, 5], [16, 17, 20]):
        expected[d] = local[s]
    for s, d in zip([6, 7, 8], [21, 22, 23]):
        expected[d, 1] = local[s, 1]
    assert torch.equal(after, expected)  # exactly those bytes changed, nothing else


def test_the_owner_refuses_what_it_did_not_grant(owner, reader):
    proc, _ = owner
    local, channel = reader
    with pytest.raises(DataPlaneError, match="token"):
        channel.read_blocks("k", "forged", [0], [0])
    with pytest.raises(DataPlaneError, match="no KV is held"):
        channel.read_blocks("other", "t", [0], [0])
    with pytest.raises(DataPlaneError, match="outside the transfer"):
        channel.read_blocks("k", "t", [15, 16], [0, 1])  # one granted block, one not
    with pytest.raises(DataPlaneError, match="outside the transfer"):
        channel.write_blocks("k", "t", [0], [3])  # readable, not writable
    with pytest.raises(DataPlaneError, match="outside the pool"):
        channel.read_blocks("k", "t", [10 ** 6], [0])
    with pytest.raises(DataPlaneError, match="layer"):
        channel.write_blocks("k", "t", [0], [16], layer=3)
    assert torch.count_nonzero(local) == 0  # not one byte came over
    assert torch.equal(owner_pool(proc), reference())  # nor went
    channel.read_blocks("k", "t", [1], [1])  # the refusals left the channel usable
    assert torch.equal(local[1], reference()[1])


def test_an_idle_owner_uses_no_cpu(owner, reader):
    """NIXL's own progress thread would busy-poll a core, and Mooncake's synchronous waits spin one: the planes
    progress and poll only while a transfer runs."""
    proc, _ = owner
    _, channel = reader
    channel.read_blocks("k", "t", [0, 1], [0, 1])  # the agents have connected and moved bytes
    before, start = cpu_seconds(proc.pid), time.monotonic()
    time.sleep(3)
    busy = (cpu_seconds(proc.pid) - before) / (time.monotonic() - start)
    assert busy < 0.1, f"the idle owner used {busy:.0%} of a core"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# A WRITE of 256 MiB over UCX's TCP transport (which moves bytes only as the writer progresses), given a deadline
# that has passed when it is posted; then another transfer progresses the writer's agent. Prints the bytes that
# had landed when the first call returned, and the bytes landed after the second.
ABANDONED_WRITE = """
import threading, time, numpy as np, torch
from pdserve.kv_transfer.data_plane import DataPlaneError
from pdserve.kv_transfer.data_plane.nixl_agent import LOCAL, NixlAgent, descriptors
cpu, size, runs = torch.device("cpu"), 256 << 20, 1024
owner, writer = NixlAgent("owner"), NixlAgent("writer")
dst, src = torch.zeros(size, dtype=torch.uint8), torch.full((size,), 7, dtype=torch.uint8)
owner.register([(dst.data_ptr(), size)], cpu)
writer.register([(src.data_ptr(), size)], cpu)
remote = writer.add_peer(owner.metadata())
owner.add_peer(writer.metadata())
stop = threading.Event()
def progress_owner():
    while not stop.is_set():
        owner.notifications()
        time.sleep(0.001)
threading.Thread(target=progress_owner, daemon=True).start()
run = size // runs
local = writer.prepare(LOCAL, descriptors(src.data_ptr() + np.arange(runs) * run, run, 0), cpu)
far = writer.prepare(remote, descriptors(dst.data_ptr() + np.arange(runs) * run, run, 0), cpu)
ids = np.arange(runs, dtype=np.int32)
try:
    writer.prepped_transfer("WRITE", local, ids, far, ids, b"late", time.monotonic())
except DataPlaneError:
    pass
landed = int((dst[:-run] == 7).sum())  # the next write rewrites the last run
writer.prepped_transfer("WRITE", local, ids[-1:], far, ids[-1:], b"next", time.monotonic() + 60)
time.sleep(0.5)
print(landed, int((dst[:-run] == 7).sum()), flush=True)
stop.set()
"""


def test_a_write_past_its_deadline_lands_nothing_after_the_call_returns(plane):
    """UCX does not cancel a posted transfer when its handle is released: a WRITE abandoned at its deadline went
    on landing in D's blocks when P's agent next progressed (after D had been told the push failed, and could
    reuse them). The call returns only once nothing of the transfer is still moving."""
    if plane not in DATA_PLANES:
        pytest.fail("NIXL is not installed")
    out = subprocess.run([sys.executable, "-c", ABANDONED_WRITE], cwd=ROOT, capture_output=True, text=True,
                         timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT), "UCX_TLS": "tcp"}, check=True)
    at_return, later = (int(n) for n in out.stdout.split())
    assert later == at_return, f"{later - at_return} bytes landed after the failed write returned"


def test_a_cache_with_a_tensor_per_layer_moves_per_block_and_layer(plane):
    """vLLM's layout (one tensor per layer, each registered once with the engine): reads move every layer of the
    blocks named, a layer write only that layer, byte for byte, between two planes in this process."""
    if plane not in DATA_PLANES:
        pytest.fail(f"the {plane} data plane's engine is not installed")
    theirs = [torch.arange(8 * 64, dtype=torch.float32).view(8, 2, 32) + 1000 * layer for layer in range(3)]
    mine = [torch.zeros(6, 2, 32) for _ in range(3)]
    owner, local = make_data_plane(plane, "127.0.0.1"), make_data_plane(plane, "127.0.0.1")
    owner.attach_regions(BlockRegions.from_layers(theirs))
    local.attach_regions(BlockRegions.from_layers(mine))
    owner.start(lambda op, key, token, ids: None if token == "t" else "wrong transfer token")
    try:
        channel = local.connect(owner.local_info())
        assert channel.read_blocks("k", "t", [7, 2], [0, 5]) == 2 * 3 * 64 * 4
        assert all(torch.equal(m[0], t[7]) and torch.equal(m[5], t[2]) for m, t in zip(mine, theirs, strict=True))
        mine[1][3].fill_(-1.0)
        channel.write_blocks("k", "t", [3], [4], layer=1)
        assert torch.equal(theirs[1][4], mine[1][3]) and not torch.equal(theirs[0][4], mine[0][3])
        with pytest.raises(DataPlaneError, match="wrong transfer token"):
            channel.read_blocks("k", "forged", [1], [1])
        channel.close()
    finally:
        owner.stop()


def test_cuda_memory_is_registered_as_vram_on_its_device(plane):
    """The GPU path cannot run on this CPU-only host: only the choice of NIXL memory type is checked."""
    assert memory_kind(torch.device("cuda", 1)) == ("VRAM", 1)
    assert memory_kind(torch.device("cpu")) == ("DRAM", 0)
