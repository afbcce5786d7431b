"""What every plane over a one-sided transfer engine shares: the pool's addresses, and the owner's grant.

A one-sided engine lets the peer read or write the owner's registered pool without the owner's code running, so
the owner authorises first: the peer asks on a socket the owner serves (tcp's listener, carrying no block
bytes), the owner runs the same capability and bounds check as on tcp and answers, and only a granted peer moves
the bytes with its engine. An engine plane supplies the registration (`GrantingPlane.register`) and the
transfer (`EngineChannel.move`). Where the transfer is complete at the owner when `move` returns (Mooncake), that
is all; an engine that needs the owner to progress it (NIXL without its progress thread) waits for the transfer
after the grant (`GrantingPlane.settle`) and confirms it on the grant's socket (`EngineChannel.owner_confirms`).

Memory is described per (block, layer) (`KvLayout`), so pdserve's pool and vLLM's tensor per layer serve alike.
"""

from __future__ import annotations

import secrets
import socket
import time
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.kv_transfer.data_plane.base import BlockRegions, DataPlane, DataPlaneError, check_block_ids
from pdserve.kv_transfer.data_plane.tcp import (SOCKET_TIMEOUT_S, TcpDataPlane, TcpPeer, recv_frame, send_frame,
                                                sorted_pairs)

# Polling a transfer backs off from a busy poll to this pause: short transfers finish in microseconds, long ones
# are not slowed by a millisecond, and a stalled one does not spin a core until its deadline.
_MAX_PAUSE_S = 0.001


def pause(attempt: int) -> float:
    return min(_MAX_PAUSE_S, 0.00001 * (2 ** min(attempt, 10))) if attempt else 0.0


@dataclass(frozen=True, slots=True)
class KvLayout:
    """Where layer l of block b lies, `bases[l] + b * strides[l]`, for pdserve's pool and vLLM's tensor per
    layer alike; on `device` (its memory is registered with the engine as that device's)."""

    bases: tuple[int, ...]
    strides: tuple[int, ...]
    layer_bytes: int
    num_blocks: int
    device: torch.device

    @classmethod
    def of(cls, regions: BlockRegions, device: torch.device) -> KvLayout:
        """From the regions' addresses alone, so that device memory, which has no host view, is described too."""
        extents = regions.layer_extents()
        bases = tuple(base for base, _ in extents)
        strides = tuple(stride if regions.num_blocks > 1 else regions.block_bytes for _, stride in extents)
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
        """Each block one span (pdserve's pool): whole blocks, and runs of adjacent blocks, are then one range."""
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

    def start(self, block: int, layer: int) -> int:
        return self.bases[layer] + block * self.strides[layer]

    def layer_starts(self) -> np.ndarray:
        """Where each layer of each block starts, at index block * num_layers + layer."""
        blocks = np.arange(self.num_blocks, dtype=np.int64)[:, None]
        starts = np.asarray(self.bases, dtype=np.int64)[None, :] + blocks * np.asarray(self.strides, dtype=np.int64)
        return starts.ravel()

    def check(self, block_ids: list[int], layer: int | None) -> None:
        check_block_ids(block_ids, self.num_blocks)
        if layer is not None and not 0 <= layer < self.num_layers:
            raise DataPlaneError(f"layer {layer} outside [0, {self.num_layers})")

    def size(self, block_ids: list[int], layer: int | None) -> int:
        return len(block_ids) * (self.block_bytes if layer is None else self.layer_bytes)


def address_runs(local: KvLayout, local_ids: list[int], remote: KvLayout, remote_ids: list[int],
                 layer: int | None) -> list[tuple[int, int, int]]:
    """(local address, remote address, length) per run of layers adjacent on both sides: in pdserve's pool a
    whole block, or a run of adjacent blocks, is one run; one layer of a block (or a layer in vLLM's tensor per
    layer) is never adjacent to the next block's, so those are one entry per block and layer."""
    layers = range(local.num_layers) if layer is None else (layer,)
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local_ids, remote_ids, strict=True):
        for n in layers:
            here, there = local.start(lb, n), remote.start(rb, n)
            if runs and runs[-1][0] + runs[-1][2] == here and runs[-1][1] + runs[-1][2] == there:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + local.layer_bytes)
            else:
                runs.append((here, there, local.layer_bytes))
    return runs


class EngineChannel(TcpPeer):
    """A channel to one owner: a pooled socket for grants, and the engine that moves the bytes once granted."""

    # Whether the owner confirms each transfer on the grant's socket once it saw it land (an engine whose owner
    # must progress the transfer, as NIXL without its progress thread); otherwise a transfer is complete at the
    # owner when `move` returns.
    owner_confirms = False

    def __init__(self, host: str, port: int, regions: BlockRegions, local: KvLayout, remote: KvLayout) -> None:
        super().__init__(host, port, regions)
        self.layout = local
        self.remote = remote
        self.closed = False

    def read_blocks(self, key: str, token: str, remote_ids: list[int], local_ids: list[int]) -> int:
        return self._granted("read", key, token, remote_ids, local_ids, None)

    def write_blocks(self, key: str, token: str, local_ids: list[int], remote_ids: list[int],
                     layer: int | None = None) -> int:
        return self._granted("write", key, token, remote_ids, local_ids, layer)

    @abstractmethod
    def move(self, op: str, local_ids: list[int], remote_ids: list[int], layer: int | None, tag: str,
             deadline: float) -> None:
        """Run the granted transfer of these blocks (or of one layer of them), read or written; `tag` names it
        to the owner."""

    def _granted(self, op: str, key: str, token: str, remote_ids: list[int], local_ids: list[int],
                 layer: int | None) -> int:
        """Ask the owner, move the bytes with the engine, and wait for the owner's confirmation if it gives one."""
        if self.closed:
            raise DataPlaneError("the channel to this peer was closed")
        remote_ids, local_ids = sorted_pairs(remote_ids, local_ids)
        self.remote.check(remote_ids, layer)
        self.layout.check(local_ids, layer)
        tag = secrets.token_hex(8)
        sock = self._take()
        try:
            send_frame(sock, {"op": op, "key": key, "token": token, "block_ids": remote_ids, "layer": layer,
                              "notif": tag})
            expect_ok(recv_frame(sock))
            self.move(op, local_ids, remote_ids, layer, tag, time.monotonic() + SOCKET_TIMEOUT_S)
            if self.owner_confirms:
                expect_ok(recv_frame(sock))  # the owner saw the transfer land
        except BaseException:
            sock.close()  # an owner waiting on this transfer stops when its socket closes
            raise
        self._give_back(sock)
        return self.layout.size(local_ids, layer)

    def close(self) -> None:
        self.closed = True
        super().close()


def expect_ok(reply: dict[str, Any]) -> None:
    if not reply.get("ok"):
        raise DataPlaneError(str(reply.get("error", "refused by the peer")))


class GrantingPlane(TcpDataPlane):
    """tcp's listener answers grants; the block bytes move by the engine. Serves pdserve's pool and vLLM's
    tensor per layer alike: the engine registers the memory once, and a block is addressed per layer (or, in
    the pool, as one span)."""

    stages = False  # its transfers move registered memory only, never a staging area

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self.layout: KvLayout | None = None

    def attach_regions(self, regions: BlockRegions) -> None:
        """Any layout, in host or device memory: the engine registers it as the regions' device's (tcp's own
        listener, which would copy bytes through the host, only answers grants here)."""
        self.regions = regions
        self._register(KvLayout.of(regions, regions.device))

    def attach(self, kv: torch.Tensor) -> None:
        DataPlane.attach(self, kv)
        if not kv.is_contiguous():
            raise DataPlaneError(f"the {self.name} data plane needs a contiguous KV pool")
        self._register(KvLayout.of(self.regions, kv.device))

    def _register(self, layout: KvLayout) -> None:
        self.register(layout)
        self.layout = layout

    @abstractmethod
    def register(self, layout: KvLayout) -> None:
        """Register the KV memory with the engine, once."""

    def local_info(self) -> dict[str, Any]:
        assert self.layout is not None
        return {"host": self.host, "port": self.port, **self.layout.wire()}

    def remote_layout(self, info: dict[str, Any]) -> KvLayout:
        """The peer's layout from its handshake, checked against ours: bytes move opaquely per layer."""
        if self.layout is None:
            raise DataPlaneError("the local KV pool is not allocated")
        layout = KvLayout.from_wire(info)
        if (layout.num_layers, layout.layer_bytes) != (self.layout.num_layers, self.layout.layer_bytes):
            raise DataPlaneError("the peer's KV block layout differs from ours")
        return layout

    def _answer(self, conn: socket.socket, request: dict[str, Any]) -> bool:
        """Grant (or refuse) one transfer, then `settle` it; False closes the connection."""
        op, block_ids, layer, tag = (request.get(k) for k in ("op", "block_ids", "layer", "notif"))
        if (op not in ("read", "write") or not isinstance(block_ids, list) or not isinstance(layer, int | None)
                or not isinstance(tag, str)):
            send_frame(conn, {"ok": False, "error": "malformed request"})
            return False
        refusal = self.authorize(op, str(request.get("key", "")), str(request.get("token", "")), block_ids)
        if refusal is None:
            try:
                self.layout.check(block_ids, layer)
            except DataPlaneError as exc:
                refusal = str(exc)
        send_frame(conn, {"ok": refusal is None, "error": refusal})
        return refusal is not None or self.settle(conn, tag)

    def settle(self, conn: socket.socket, tag: str) -> bool:
        """What the owner does after a grant while the peer moves the bytes; False closes the connection. An
        engine that completes a transfer without the owner needs nothing."""
        return True
