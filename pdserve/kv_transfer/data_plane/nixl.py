"""NIXL between any two instances: the peer reads (pull) or writes (push) the pool owner's registered memory
itself, one prepared NIXL transfer per load or per layer, over whatever UCX finds (cross-memory attach on one
host, TCP between hosts).

The owner registers its pool with NIXL once and sends its agent's metadata in the handshake; each side prepares
descriptor lists once (the owner's pool by block and by block x layer; the peer's per peer). NIXL transfers
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
import time
from typing import Any

import torch

from pdserve.kv_transfer.data_plane.base import BlockRegions, DataPlane, DataPlaneError
from pdserve.kv_transfer.data_plane.nixl_agent import NixlEndpoint, PoolLayout, PreparedSide
from pdserve.kv_transfer.data_plane.tcp import (SOCKET_TIMEOUT_S, TcpDataPlane, TcpPeer, recv_frame, send_frame,
                                                sorted_pairs)



class NixlPeer(TcpPeer):
    """A channel to one peer: its agent, its prepared descriptor lists and a pooled socket for grants."""

    def __init__(self, endpoint: NixlEndpoint, remote: str, side: PreparedSide, host: str, port: int,
                 local: BlockRegions) -> None:
        super().__init__(host, port, local)
        self.endpoint = endpoint
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
        side, local = self.side, self.endpoint.local
        if side is None or local is None:
            raise DataPlaneError("the nixl channel to this peer was closed")
        remote_ids, local_ids = sorted_pairs(remote_ids, local_ids)
        side.layout.check(remote_ids, layer)
        local.layout.check(local_ids, layer)
        notif = secrets.token_hex(8)
        sock = self._take()
        try:
            send_frame(sock, {"op": op, "key": key, "token": token, "block_ids": remote_ids, "layer": layer,
                              "notif": notif})
            _expect_ok(recv_frame(sock))
            self.endpoint.transfer("READ" if op == "read" else "WRITE", side, remote_ids, local_ids, layer,
                                   notif.encode(), time.monotonic() + SOCKET_TIMEOUT_S)
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
            self.endpoint.drop_peer(self.remote, side)


def _expect_ok(reply: dict[str, Any]) -> None:
    if not reply.get("ok"):
        raise DataPlaneError(str(reply.get("error", "refused by the peer")))


def _gone(conn: socket.socket, wait_s: float) -> bool:
    """The initiator sends nothing while its transfer runs: anything readable means it closed or gave up."""
    return bool(select.select([conn], [], [], wait_s)[0])


class NixlDataPlane(TcpDataPlane):
    """tcp's listener answers grants; the block bytes move by NIXL."""

    name = "nixl"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host, port)
        self.endpoint: NixlEndpoint | None = None
        self.layout: PoolLayout | None = None

    def attach_regions(self, regions: BlockRegions) -> None:
        DataPlane.attach_regions(self, regions)  # NIXL registers pdserve's one pool tensor (not yet vLLM's)

    def attach(self, kv: torch.Tensor) -> None:
        DataPlane.attach(self, kv)
        self.endpoint = NixlEndpoint(f"pdserve-{os.getpid()}-{secrets.token_hex(6)}")
        self.layout = self.endpoint.register(kv)

    def _answer(self, conn: socket.socket, request: dict[str, Any]) -> bool:
        """Grant (or refuse) one transfer, then progress until it lands; False closes the connection."""
        op, block_ids, layer, notif = (request.get(k) for k in ("op", "block_ids", "layer", "notif"))
        if op not in ("read", "write") or not isinstance(block_ids, list) or not isinstance(notif, str):
            send_frame(conn, {"ok": False, "error": "malformed request"})
            return False
        refusal = self.authorize(op, str(request.get("key", "")), str(request.get("token", "")), block_ids)
        if refusal is None:
            try:
                self.layout.check(block_ids, layer)
            except DataPlaneError as exc:
                refusal = str(exc)
        if refusal is not None:
            send_frame(conn, {"ok": False, "error": refusal})
            return True
        send_frame(conn, {"ok": True})
        deadline = time.monotonic() + SOCKET_TIMEOUT_S
        if not self.endpoint.await_notif(notif.encode(), deadline, lambda wait_s: _gone(conn, wait_s)):
            return False
        send_frame(conn, {"ok": True})
        return True

    def local_info(self) -> dict[str, Any]:
        assert self.kv is not None and self.endpoint is not None
        return {"host": self.host, "port": self.port, "agent": self.endpoint.name,
                "metadata": base64.b64encode(self.endpoint.metadata()).decode(), "addr": self.kv.data_ptr(),
                "shape": list(self.kv.shape), "dtype": str(self.kv.dtype).removeprefix("torch.")}

    def connect(self, info: dict[str, Any]) -> NixlPeer:
        if self.kv is None or self.endpoint is None:
            raise DataPlaneError("the local KV pool is not allocated")
        shape = [int(n) for n in info["shape"]]
        if shape[1:] != list(self.kv.shape[1:]) or info["dtype"] != str(self.kv.dtype).removeprefix("torch."):
            raise DataPlaneError("the peer's KV block layout differs from ours")
        layout = PoolLayout(int(info["addr"]), shape, self.kv.element_size())
        remote, side = self.endpoint.add_peer(base64.b64decode(info["metadata"]), layout)
        return NixlPeer(self.endpoint, remote, side, str(info["host"]), int(info["port"]), self.regions)
