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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.kv_transfer.data_plane.base import BlockRegions, DataPlane, DataPlaneError, check_block_ids
from pdserve.kv_transfer.data_plane.nixl_agent import LOCAL, NixlAgent, descriptors, memory_kind
from pdserve.kv_transfer.data_plane.tcp import (SOCKET_TIMEOUT_S, TcpDataPlane, TcpPeer, recv_frame, send_frame,
                                                sorted_pairs)


@dataclass(frozen=True, slots=True)
class KvLayout:
    """Where layer l of block b lies, `bases[l] + b * strides[l]`, for pdserve's pool and vLLM's tensor per
    layer alike; on `device` (its memory is registered with NIXL as that device's)."""

    bases: tuple[int, ...]
    strides: tuple[int, ...]
    layer_bytes: int
    num_blocks: int
    device: torch.device

    @classmethod
    def of(cls, regions: BlockRegions, device: torch.device) -> KvLayout:
        def address(block: int, layer: int) -> int:
            return int(np.frombuffer(regions.layer_view(block, layer), dtype=np.uint8).ctypes.data)

        bases = tuple(address(0, layer) for layer in range(regions.num_layers))
        strides = tuple((address(1, layer) - base) if regions.num_blocks > 1 else regions.block_bytes
                        for layer, base in enumerate(bases))
        return cls(bases, strides, regions.layer_bytes, regions.num_blocks, device)

    @classmethod
    def from_wire(cls, info: dict[str, Any]) -> KvLayout:
        return cls(tuple(int(b) for b in info["bases"]), tuple(int(s) for s in info["strides"]),
                   int(info["layer_bytes"]), int(info["num_blocks"]), torch.device(str(info["device"])))

    def wire(self) -> dict[str, Any]:
        return {"bases": list(self.bases), "strides": list(self.strides), "layer_bytes": self.layer_bytes,
                "num_blocks": self.num_blocks, "device": str(self.device)}

    @property
    def num_layers(self) -> int:
        return len(self.bases)

    @property
    def block_bytes(self) -> int:
        return self.layer_bytes * self.num_layers

    @property
    def contiguous(self) -> bool:
        """Each block one span (pdserve's pool): whole blocks then move as one descriptor each."""
        return all(base == self.bases[0] + i * self.layer_bytes and stride == self.block_bytes
                   for i, (base, stride) in enumerate(zip(self.bases, self.strides, strict=True)))

    def memory(self) -> list[tuple[int, int]]:
        """The (address, bytes) ranges to register: each layer's span, overlapping spans merged (the pool's
        layers interleave into one range; vLLM's layers are a tensor each)."""
        spans = sorted((base, base + (self.num_blocks - 1) * stride + self.layer_bytes)
                       for base, stride in zip(self.bases, self.strides, strict=True))
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [(start, end - start) for start, end in merged]

    def layer_descs(self) -> np.ndarray:
        """Index block * num_layers + layer: one layer of one block."""
        blocks = np.arange(self.num_blocks, dtype=np.int64)[:, None]
        starts = np.asarray(self.bases, dtype=np.int64)[None, :] + blocks * np.asarray(self.strides, dtype=np.int64)
        return descriptors(starts.ravel(), self.layer_bytes, memory_kind(self.device)[1])

    def block_descs(self) -> np.ndarray:
        starts = self.bases[0] + np.arange(self.num_blocks, dtype=np.int64) * self.block_bytes
        return descriptors(starts, self.block_bytes, memory_kind(self.device)[1])

    def indices(self, block_ids: list[int], layer: int | None, whole_blocks: bool) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64)
        if layer is not None:
            ids = ids * self.num_layers + layer
        elif not whole_blocks:
            ids = (ids[:, None] * self.num_layers + np.arange(self.num_layers, dtype=np.int64)[None, :]).ravel()
        return ids.astype(np.int32)

    def check(self, block_ids: list[int], layer: int | None) -> None:
        check_block_ids(block_ids, self.num_blocks)
        if layer is not None and not 0 <= layer < self.num_layers:
            raise DataPlaneError(f"layer {layer} outside [0, {self.num_layers})")

    def size(self, block_ids: list[int], layer: int | None) -> int:
        return len(block_ids) * (self.block_bytes if layer is None else self.layer_bytes)


class PreparedSide:
    """One side's descriptor lists, prepared once: single layers of blocks, and whole blocks where a block is
    one span."""

    def __init__(self, agent: NixlAgent, owner: str, layout: KvLayout) -> None:
        self.layout = layout
        self.layers = agent.prepare(owner, layout.layer_descs(), layout.device)
        self.blocks = agent.prepare(owner, layout.block_descs(), layout.device) if layout.contiguous else None

    def release(self, agent: NixlAgent) -> None:
        for handle in (self.layers, self.blocks):
            if handle is not None:
                agent.release(handle)


class NixlPeer(TcpPeer):
    """A channel to one peer: its prepared descriptor lists and a pooled socket for grants."""

    def __init__(self, plane: NixlDataPlane, remote: str, side: PreparedSide, host: str, port: int) -> None:
        super().__init__(host, port, plane.regions)
        self.plane = plane
        self.remote = remote
        self.side: PreparedSide | None = side

    def read_blocks(self, key: str, token: str, remote_ids: list[int], local_ids: list[int]) -> int:
        return self._granted("read", key, token, remote_ids, local_ids, None)

    def write_blocks(self, key: str, token: str, local_ids: list[int], remote_ids: list[int],
                     layer: int | None = None) -> int:
        return self._granted("write", key, token, remote_ids, local_ids, layer)

    def _granted(self, op: str, key: str, token: str, remote_ids: list[int], local_ids: list[int],
                 layer: int | None) -> int:
        """Ask the owner, move the bytes with one NIXL transfer, and wait for the owner's confirmation."""
        side, local, agent = self.side, self.plane.prepared, self.plane.agent
        if side is None or local is None or agent is None:
            raise DataPlaneError("the nixl channel to this peer was closed")
        remote_ids, local_ids = sorted_pairs(remote_ids, local_ids)
        side.layout.check(remote_ids, layer)
        local.layout.check(local_ids, layer)
        whole = layer is None and side.blocks is not None and local.blocks is not None
        notif = secrets.token_hex(8)
        sock = self._take()
        try:
            send_frame(sock, {"op": op, "key": key, "token": token, "block_ids": remote_ids, "layer": layer,
                              "notif": notif})
            _expect_ok(recv_frame(sock))
            agent.prepped_transfer(
                "READ" if op == "read" else "WRITE", local.blocks if whole else local.layers,
                local.layout.indices(local_ids, layer, whole), side.blocks if whole else side.layers,
                side.layout.indices(remote_ids, layer, whole), notif.encode(), time.monotonic() + SOCKET_TIMEOUT_S)
            _expect_ok(recv_frame(sock))  # the owner saw the transfer's notification
        except BaseException:
            sock.close()  # the owner stops progressing for this transfer when its socket closes
            raise
        self._give_back(sock)
        return local.layout.size(local_ids, layer)

    def close(self) -> None:
        super().close()
        side, self.side = self.side, None
        if side is not None:
            self.plane.drop_peer(self.remote, side)


def _expect_ok(reply: dict[str, Any]) -> None:
    if not reply.get("ok"):
        raise DataPlaneError(str(reply.get("error", "refused by the peer")))


def _gone(conn: socket.socket, wait_s: float) -> bool:
    """The initiator sends nothing while its transfer runs: anything readable means it closed or gave up."""
    return bool(select.select([conn], [], [], wait_s)[0])


class NixlDataPlane(TcpDataPlane):
    """tcp's listener answers grants; the block bytes move by NIXL. Serves pdserve's pool and vLLM's tensor per
    layer alike: each is registered with NIXL once, and a block is addressed per layer (or, in the pool, as one
    span)."""

    name = "nixl"
    stages = False  # its transfers move registered memory only, never a staging area

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self.agent: NixlAgent | None = None
        self.prepared: PreparedSide | None = None
        self._lock = threading.Lock()
        self._remotes: dict[str, int] = {}  # remote agent -> channels using it

    def attach_regions(self, regions: BlockRegions) -> None:
        super().attach_regions(regions)
        self._register(KvLayout.of(regions, torch.device("cpu")))  # BlockRegions are host byte views

    def attach(self, kv: torch.Tensor) -> None:
        DataPlane.attach(self, kv)
        if not kv.is_contiguous():
            raise DataPlaneError("the nixl data plane needs a contiguous KV pool")
        self._register(KvLayout.of(self.regions, kv.device))

    def _register(self, layout: KvLayout) -> None:
        """Register the KV memory with NIXL once, and prepare its local descriptor lists."""
        self.agent = NixlAgent(f"pdserve-{os.getpid()}-{secrets.token_hex(6)}")
        self.agent.register(layout.memory(), layout.device)
        self.prepared = PreparedSide(self.agent, LOCAL, layout)

    def _answer(self, conn: socket.socket, request: dict[str, Any]) -> bool:
        """Grant (or refuse) one transfer, then progress until it lands; False closes the connection."""
        op, block_ids, layer, notif = (request.get(k) for k in ("op", "block_ids", "layer", "notif"))
        if op not in ("read", "write") or not isinstance(block_ids, list) or not isinstance(notif, str):
            send_frame(conn, {"ok": False, "error": "malformed request"})
            return False
        refusal = self.authorize(op, str(request.get("key", "")), str(request.get("token", "")), block_ids)
        if refusal is None:
            try:
                self.prepared.layout.check(block_ids, layer)
            except DataPlaneError as exc:
                refusal = str(exc)
        if refusal is not None:
            send_frame(conn, {"ok": False, "error": refusal})
            return True
        send_frame(conn, {"ok": True})
        deadline = time.monotonic() + SOCKET_TIMEOUT_S
        if not self.agent.await_notif(notif.encode(), deadline, lambda wait_s: _gone(conn, wait_s)):
            return False
        send_frame(conn, {"ok": True})
        return True

    def local_info(self) -> dict[str, Any]:
        assert self.prepared is not None and self.agent is not None
        return {"host": self.host, "port": self.port, "agent": self.agent.name,
                "metadata": base64.b64encode(self.agent.metadata()).decode(), **self.prepared.layout.wire()}

    def connect(self, info: dict[str, Any]) -> NixlPeer:
        if self.prepared is None or self.agent is None:
            raise DataPlaneError("the local KV pool is not allocated")
        layout = KvLayout.from_wire(info)
        mine = self.prepared.layout
        if (layout.num_layers, layout.layer_bytes) != (mine.num_layers, mine.layer_bytes):
            raise DataPlaneError("the peer's KV block layout differs from ours")
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
