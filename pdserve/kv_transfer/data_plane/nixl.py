"""NIXL between any two instances: the peer reads (pull) or writes (push) the pool owner's registered memory
itself, one prepared NIXL transfer per load or per layer, over whatever UCX finds (cross-memory attach on one
host, TCP between hosts).

The owner registers its KV memory with NIXL once (pdserve's pool, or vLLM's tensor per layer) and sends its
agent's metadata and layout in the handshake; each side prepares descriptor lists once (the owner's by block x
layer, and by block where a block is one span; the peer's per peer). NIXL transfers
are one-sided, so authorisation happens first, on the owner: the peer asks on a socket the owner serves (tcp's
listener, carrying no block bytes), the owner runs the same capability check as on tcp and answers; only a
granted peer starts the transfer, and the owner then progresses its agent until the transfer's NIXL
notification arrives and confirms it. As with shm, a peer holding the metadata could skip the question: the
check stops forged or stale transfer parameters reaching an honest instance; between instances that do not
trust each other, use the tcp plane.
"""

from __future__ import annotations

import base64
import os
import secrets
import select
import socket
import threading
import time
from typing import Any

import numpy as np

from pdserve.kv_transfer.data_plane.base import DataPlaneError
from pdserve.kv_transfer.data_plane.nixl_agent import LOCAL, NixlAgent, descriptors, memory_kind
from pdserve.kv_transfer.data_plane.one_sided import EngineChannel, GrantingPlane, KvLayout
from pdserve.kv_transfer.data_plane.tcp import SOCKET_TIMEOUT_S, send_frame


def indices(layout: KvLayout, block_ids: list[int], layer: int | None, whole_blocks: bool) -> np.ndarray:
    """Indices into a side's prepared lists: block * num_layers + layer in the list of layers, the block in
    the list of whole blocks."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if layer is not None:
        ids = ids * layout.num_layers + layer
    elif not whole_blocks:
        ids = (ids[:, None] * layout.num_layers + np.arange(layout.num_layers, dtype=np.int64)[None, :]).ravel()
    return ids.astype(np.int32)


class PreparedSide:
    """One side's descriptor lists, prepared once: single layers of blocks, and whole blocks where a block is
    one span."""

    def __init__(self, agent: NixlAgent, owner: str, layout: KvLayout) -> None:
        self.layout = layout
        device_id = memory_kind(layout.device)[1]
        self.layers = agent.prepare(owner, descriptors(layout.layer_starts(), layout.layer_bytes, device_id),
                                    layout.device)
        self.blocks = None
        if layout.contiguous:
            starts = layout.bases[0] + np.arange(layout.num_blocks, dtype=np.int64) * layout.block_bytes
            self.blocks = agent.prepare(owner, descriptors(starts, layout.block_bytes, device_id), layout.device)

    def release(self, agent: NixlAgent) -> None:
        for handle in (self.layers, self.blocks):
            if handle is not None:
                agent.release(handle)


class NixlPeer(EngineChannel):
    """A channel to one peer: its prepared descriptor lists, and the owner's confirmation of each transfer."""

    owner_confirms = True

    def __init__(self, plane: NixlDataPlane, remote: str, side: PreparedSide, host: str, port: int) -> None:
        super().__init__(host, port, plane.regions, plane.layout, side.layout)
        self.plane = plane
        self.remote_agent = remote
        self.side = side

    def move(self, op: str, local_ids: list[int], remote_ids: list[int], layer: int | None, tag: str,
             deadline: float) -> None:
        """One NIXL transfer, whose notification tells the owner it landed."""
        side, local = self.side, self.plane.prepared
        whole = layer is None and side.blocks is not None and local.blocks is not None
        self.plane.agent.prepped_transfer(
            "READ" if op == "read" else "WRITE", local.blocks if whole else local.layers,
            indices(self.layout, local_ids, layer, whole), side.blocks if whole else side.layers,
            indices(self.remote, remote_ids, layer, whole), tag.encode(), deadline)

    def close(self) -> None:
        closed, self.closed = self.closed, True
        super().close()
        if not closed:
            self.plane.drop_peer(self.remote_agent, self.side)


def _gone(conn: socket.socket, wait_s: float) -> bool:
    """The initiator sends nothing while its transfer runs: anything readable means it closed or gave up."""
    return bool(select.select([conn], [], [], wait_s)[0])


class NixlDataPlane(GrantingPlane):
    name = "nixl"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self.agent: NixlAgent | None = None
        self.prepared: PreparedSide | None = None
        self._lock = threading.Lock()
        self._remotes: dict[str, int] = {}  # remote agent -> channels using it

    def register(self, layout: KvLayout) -> None:
        """Register the KV memory with NIXL once, and prepare its local descriptor lists."""
        self.agent = NixlAgent(f"pdserve-{os.getpid()}-{secrets.token_hex(6)}")
        self.agent.register(layout.memory(), layout.device)
        self.prepared = PreparedSide(self.agent, LOCAL, layout)

    def settle(self, conn: socket.socket, tag: str) -> bool:
        """Progress the agent until the granted transfer's notification arrives, then confirm it."""
        deadline = time.monotonic() + SOCKET_TIMEOUT_S
        if not self.agent.await_notif(tag.encode(), deadline, lambda wait_s: _gone(conn, wait_s)):
            return False
        send_frame(conn, {"ok": True})
        return True

    def local_info(self) -> dict[str, Any]:
        assert self.agent is not None
        return {**super().local_info(), "agent": self.agent.name,
                "metadata": base64.b64encode(self.agent.metadata()).decode()}

    def connect(self, info: dict[str, Any]) -> NixlPeer:
        layout = self.remote_layout(info)
        with self._lock:
            remote = self.agent.add_peer(base64.b64decode(info["metadata"]))
            self._remotes[remote] = self._remotes.get(remote, 0) + 1
        return NixlPeer(self, remote, PreparedSide(self.agent, remote, layout), str(info["host"]), int(info["port"]))

    def drop_peer(self, remote: str, side: PreparedSide) -> None:
        """Forget a peer's descriptor lists, and its agent when no channel uses it any more. Best effort: a
        channel is dropped after a failure, and a NIXL error here must not hide that failure."""
        side.release(self.agent)
        with self._lock:
            self._remotes[remote] -= 1
            if self._remotes[remote]:
                return
            del self._remotes[remote]
            try:
                self.agent.remove_peer(remote)
            except DataPlaneError:
                pass
