"""TCP between any two hosts: the pool owner serves block reads (and accepts layer writes) over a socket.

Blocks are located through `BlockRegions`, so pdserve's pool and vLLM's per-layer cache serve alike. One
request moves every block of a transfer: a small msgpack header, then the raw bytes streamed straight
from (or into) the KV pool's memory with ``sendall`` / ``recv_into``, so there is no round trip per block and
no staging copy. Connections are kept and reused.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

import msgspec
import torch

from pdserve.kv_transfer.data_plane.base import (SOCKET_TIMEOUT_S, BlockRegions, DataPlane, DataPlaneError,
                                                 PeerChannel, accept_until_stopped, refuse_device_memory)

_LEN = struct.Struct("!I")
_MAX_HEADER = 1 << 20


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = msgspec.msgpack.encode(obj)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    head = bytearray(_LEN.size)
    recv_exact(sock, memoryview(head))
    (length,) = _LEN.unpack(head)
    if length > _MAX_HEADER:
        raise DataPlaneError(f"header of {length} bytes is too large")
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    frame = msgspec.msgpack.decode(bytes(body))
    if not isinstance(frame, dict):
        raise DataPlaneError("malformed frame")
    return frame


class TcpPeer(PeerChannel):
    def __init__(self, host: str, port: int, local: BlockRegions) -> None:
        self.address = (host, port)
        self.local = local
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def _take(self) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        sock = socket.create_connection(self.address, timeout=SOCKET_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append(sock)

    def _exchange(self, header: dict[str, Any], send: list[memoryview], receive: list[memoryview]) -> dict[str, Any]:
        sock = self._take()
        try:
            send_frame(sock, header)
            for view in send:
                sock.sendall(view)
            reply = recv_frame(sock)
            if not reply.get("ok"):
                raise DataPlaneError(str(reply.get("error", "refused by the peer")))
            for view in receive:
                recv_exact(sock, view)
        except BaseException:
            sock.close()
            raise
        self._give_back(sock)
        return reply

    def read_blocks(self, key: str, token: str, remote_ids: list[int], local_ids: list[int]) -> int:
        return self.read_into(key, token, remote_ids, local_ids, self.local)

    def read_into(self, key: str, token: str, remote_ids: list[int], staged_ids: list[int],
                  staging: BlockRegions) -> int:
        # Ask in ascending remote order (the peer then sends few long runs), receive in that same order.
        remote, local = sorted_pairs(remote_ids, staged_ids)
        self._exchange({"op": "read", "key": key, "token": token, "block_ids": remote}, [], staging.spans(local, None))
        return staging.size(staged_ids, None)

    def write_blocks(self, key: str, token: str, local_ids: list[int], remote_ids: list[int],
                     layer: int | None = None) -> int:
        return self.write_from(key, token, local_ids, remote_ids, self.local, layer)

    def write_from(self, key: str, token: str, staged_ids: list[int], remote_ids: list[int],
                   staging: BlockRegions, layer: int | None = None) -> int:
        remote, local = sorted_pairs(remote_ids, staged_ids)
        nbytes = staging.size(local, layer)
        self._exchange({"op": "write", "key": key, "token": token, "block_ids": remote, "layer": layer,
                        "nbytes": nbytes}, staging.spans(local, layer), [])
        return nbytes

    def close(self) -> None:
        with self._lock:
            for sock in self._idle:
                sock.close()
            self._idle.clear()


def sorted_pairs(remote_ids: list[int], local_ids: list[int]) -> tuple[list[int], list[int]]:
    pairs = sorted(zip(remote_ids, local_ids, strict=True))
    return [r for r, _ in pairs], [b for _, b in pairs]


class TcpDataPlane(DataPlane):
    name = "tcp"
    stages = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host)
        self.requested_port = port
        self.port = 0
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.attach(torch.zeros(shape, dtype=dtype))
        return self.kv

    def attach_regions(self, regions: BlockRegions) -> None:
        """Any layout in host memory serves: the socket moves each block's bytes as they lie."""
        refuse_device_memory(self.name, regions.device)
        self.regions = regions

    def start(self, authorize) -> None:
        super().start(authorize)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.requested_port))
        listener.listen(128)
        listener.settimeout(0.2)
        self._listener = listener
        self.port = listener.getsockname()[1]
        thread = threading.Thread(target=self._accept_loop, name="pdserve-tcp-accept", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept_loop(self) -> None:
        accept_until_stopped(self._listener, self._stopping, self._spawn_server)

    def _spawn_server(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self._serve, args=(conn,), name="pdserve-tcp-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(None)
        with conn:
            while not self._stopping.is_set():
                try:
                    request = recv_frame(conn)
                except (OSError, ConnectionError, DataPlaneError, msgspec.DecodeError):
                    return
                if not self._answer(conn, request):
                    return

    def _answer(self, conn: socket.socket, request: dict[str, Any]) -> bool:
        """Serve one request; False closes the connection (the stream can no longer be trusted)."""
        op = request.get("op")
        block_ids = request.get("block_ids")
        layer = request.get("layer")
        if op not in ("read", "write") or not isinstance(block_ids, list):
            send_frame(conn, {"ok": False, "error": "malformed request"})
            return False
        refusal = self.authorize(op, str(request.get("key", "")), str(request.get("token", "")), block_ids)
        try:
            spans = self.regions.spans(block_ids, layer) if refusal is None else []
        except DataPlaneError as exc:
            refusal = str(exc)
        if op == "write" and refusal is None and request.get("nbytes") != self.regions.size(block_ids, layer):
            refusal = "write size does not match the blocks named"
        if refusal is not None:
            send_frame(conn, {"ok": False, "error": refusal})
            return op == "read"  # a refused write leaves unread bytes on the wire
        try:
            if op == "read":
                send_frame(conn, {"ok": True, "nbytes": self.regions.size(block_ids, layer)})
                for view in spans:
                    conn.sendall(view)
            else:
                for view in spans:
                    recv_exact(conn, view)
                send_frame(conn, {"ok": True})
        except (OSError, ConnectionError):
            return False
        return True

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()

    def local_info(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port}

    def connect(self, info: dict[str, Any]) -> PeerChannel:
        if self.regions is None:
            raise DataPlaneError("the local KV pool is not allocated")
        return TcpPeer(str(info["host"]), int(info["port"]), self.regions)
