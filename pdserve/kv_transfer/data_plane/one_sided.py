"""What every plane over a one-sided transfer engine shares: the pool's addresses, and the owner's grant.

A one-sided engine lets the peer read or write the owner's registered pool without the owner's code running, so
the owner authorises first: the peer asks on a socket the owner serves (tcp's listener, carrying no block
bytes), the owner runs the same capability and bounds check as on tcp and answers, and only a granted peer moves
the bytes with its engine. An engine plane supplies the registration (`GrantingPlane.register`) and the
transfer (`EngineChannel.move`); the transfer must be complete at the owner when `move` returns (an engine that
needs the owner to progress it, as NIXL without its progress thread does, would add a wait after the grant).
"""

from __future__ import annotations

import socket
import time
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

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
class PoolAddresses:
    """Where each block, and each layer of each block, of a contiguous pool `[blocks, layers, ...]` lies."""

    addr: int
    num_blocks: int
    num_layers: int
    block_bytes: int

    @classmethod
    def of(cls, kv: torch.Tensor) -> PoolAddresses:
        if not (kv.device.type == "cpu" and kv.is_contiguous()):
            raise DataPlaneError("a one-sided data plane needs a contiguous host KV pool")
        return cls(kv.data_ptr(), kv.shape[0], kv.shape[1], kv[0].numel() * kv.element_size())

    @property
    def layer_bytes(self) -> int:
        return self.block_bytes // self.num_layers

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def check(self, block_ids: list[int], layer: int | None) -> None:
        check_block_ids(block_ids, self.num_blocks)
        if layer is not None and not 0 <= layer < self.num_layers:
            raise DataPlaneError(f"layer {layer} outside [0, {self.num_layers})")

    def size(self, block_ids: list[int], layer: int | None) -> int:
        return len(block_ids) * (self.block_bytes if layer is None else self.layer_bytes)

    def start(self, block: int, layer: int | None) -> int:
        return self.addr + block * self.block_bytes + (0 if layer is None else layer * self.layer_bytes)


def address_runs(local: PoolAddresses, local_ids: list[int], remote: PoolAddresses, remote_ids: list[int],
                 layer: int | None) -> list[tuple[int, int, int]]:
    """(local address, remote address, length) per run of blocks adjacent on both sides; one layer of a block is
    never adjacent to the next block's, so layer transfers are one entry per block."""
    length = local.block_bytes if layer is None else local.layer_bytes
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local_ids, remote_ids, strict=True):
        here, there = local.start(lb, layer), remote.start(rb, layer)
        if runs and runs[-1][0] + runs[-1][2] == here and runs[-1][1] + runs[-1][2] == there:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + length)
        else:
            runs.append((here, there, length))
    return runs


def pool_info(kv: torch.Tensor) -> dict[str, Any]:
    """The handshake's description of the pool the peer will address."""
    return {"addr": kv.data_ptr(), "shape": list(kv.shape), "dtype": str(kv.dtype).removeprefix("torch.")}


def remote_pool(info: dict[str, Any], kv: torch.Tensor) -> PoolAddresses:
    """The peer's pool from its handshake, checked against ours: bytes move opaquely, so layouts must match."""
    shape = [int(n) for n in info["shape"]]
    if shape[1:] != list(kv.shape[1:]) or info["dtype"] != str(kv.dtype).removeprefix("torch."):
        raise DataPlaneError("the peer's KV block layout differs from ours")
    return PoolAddresses(int(info["addr"]), shape[0], shape[1], kv[0].numel() * kv.element_size())


class EngineChannel(TcpPeer):
    """A channel to one owner: a pooled socket for grants, and the engine that moves the bytes once granted."""

    def __init__(self, host: str, port: int, regions: BlockRegions, local: PoolAddresses,
                 remote: PoolAddresses) -> None:
        super().__init__(host, port, regions)
        self.pool = local
        self.remote = remote
        self.closed = False

    def read_blocks(self, key: str, token: str, remote_ids: list[int], local_ids: list[int]) -> int:
        return self._granted("read", key, token, remote_ids, local_ids, None)

    def write_blocks(self, key: str, token: str, local_ids: list[int], remote_ids: list[int],
                     layer: int | None = None) -> int:
        return self._granted("write", key, token, remote_ids, local_ids, layer)

    @abstractmethod
    def move(self, op: str, runs: list[tuple[int, int, int]], deadline: float) -> None:
        """Run the granted transfer: (local address, remote address, length) runs, read or written."""

    def _granted(self, op: str, key: str, token: str, remote_ids: list[int], local_ids: list[int],
                 layer: int | None) -> int:
        if self.closed:
            raise DataPlaneError("the channel to this peer was closed")
        remote_ids, local_ids = sorted_pairs(remote_ids, local_ids)
        self.remote.check(remote_ids, layer)
        self.pool.check(local_ids, layer)
        sock = self._take()
        try:
            send_frame(sock, {"op": op, "key": key, "token": token, "block_ids": remote_ids, "layer": layer})
            expect_ok(recv_frame(sock))
            self.move(op, address_runs(self.pool, local_ids, self.remote, remote_ids, layer),
                      time.monotonic() + SOCKET_TIMEOUT_S)
        except BaseException:
            sock.close()
            raise
        self._give_back(sock)
        return self.pool.size(local_ids, layer)

    def close(self) -> None:
        self.closed = True
        super().close()


def expect_ok(reply: dict[str, Any]) -> None:
    if not reply.get("ok"):
        raise DataPlaneError(str(reply.get("error", "refused by the peer")))


class GrantingPlane(TcpDataPlane):
    """tcp's listener answers grants; the block bytes move by the engine. Serves pdserve's own pool only: the
    engine registers that one tensor."""

    stages = False  # its transfers move registered memory only, never a staging area

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self.pool: PoolAddresses | None = None

    def attach_regions(self, regions: BlockRegions) -> None:
        DataPlane.attach_regions(self, regions)

    def attach(self, kv: torch.Tensor) -> None:
        DataPlane.attach(self, kv)
        self.pool = PoolAddresses.of(kv)
        self.register(kv)

    @abstractmethod
    def register(self, kv: torch.Tensor) -> None:
        """Register the pool with the engine, once."""

    def _answer(self, conn: socket.socket, request: dict[str, Any]) -> bool:
        op, block_ids, layer = request.get("op"), request.get("block_ids"), request.get("layer")
        if op not in ("read", "write") or not isinstance(block_ids, list) or not isinstance(layer, int | None):
            send_frame(conn, {"ok": False, "error": "malformed request"})
            return False
        refusal = self.authorize(op, str(request.get("key", "")), str(request.get("token", "")), block_ids)
        if refusal is None:
            try:
                self.pool.check(block_ids, layer)
            except DataPlaneError as exc:
                refusal = str(exc)
        send_frame(conn, {"ok": refusal is None, "error": refusal})
        return True
