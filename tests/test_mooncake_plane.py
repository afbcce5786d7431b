"""What the mooncake plane adds to the one-sided planes' checks (tests/test_nixl_plane.py): a transfer the engine
itself fails (an address the owner never registered, a peer whose engine is gone) ends in a DataPlaneError well
before its deadline, and the channel still moves the right bytes afterwards."""

from __future__ import annotations

import time

import pytest
import torch
from server_utils import data_planes

from pdserve.kv_transfer.data_plane import DATA_PLANES, DataPlaneError, make_data_plane

pytestmark = [pytest.mark.parametrize("plane", data_planes("mooncake")), pytest.mark.core]

SHAPE = (8, 2, 2, 2, 4, 8)


@pytest.fixture()
def pair(plane):
    if plane not in DATA_PLANES:
        pytest.fail("the mooncake data plane's engine is not installed")
    owner, reader = make_data_plane(plane, "127.0.0.1"), make_data_plane(plane, "127.0.0.1")
    pool = owner.allocate(SHAPE, torch.float32)
    pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).view(SHAPE))
    owner.start(lambda op, key, token, ids: None)
    reader.allocate(SHAPE, torch.float32)
    channel = reader.connect(owner.local_info())
    try:
        yield owner, reader, channel
    finally:
        channel.close()
        owner.stop()
        reader.stop()


def test_an_engine_failure_is_a_prompt_data_plane_error(pair):
    owner, reader, channel = pair
    unregistered = max(addr + n for addr, n in owner.layout.memory()) + (1 << 20)
    here = reader.layout.bases[0]
    start = time.monotonic()
    with pytest.raises(DataPlaneError, match="failed"):
        reader.engine.transfer(channel.session, "read", [(here, unregistered, 4096)],
                               time.monotonic() + 30)
    with pytest.raises(DataPlaneError, match="failed"):
        reader.engine.transfer("127.0.0.1:1", "read", [(here, owner.layout.bases[0], 4096)],
                               time.monotonic() + 30)
    assert time.monotonic() - start < 10
    assert torch.count_nonzero(reader.kv) == 0
    channel.read_blocks("k", "t", [5, 6], [1, 2])  # the engine and the channel still work
    assert torch.equal(reader.kv[1:3], owner.kv[5:7])
