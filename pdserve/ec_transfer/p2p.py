"""EC over the instance's side channel: the encode instance keeps outputs in memory (bounded, with a time to
live) and serves them by mm_hash to whoever holds the item's token; a consumer fetches with a deadline."""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import zmq

from pdserve.ec_transfer.base import DTYPES, ECConnector, ECLoadError, tensor_checksum
from pdserve.ec_transfer.params import ECSource
from pdserve.kv_transfer.faults import FaultConfig
from pdserve.kv_transfer.messages import ECData, ECFetch, ProtocolError, decode, encode


@dataclass(slots=True)
class _Stored:
    tensor: torch.Tensor
    checksum: int
    token: str
    expires_at: float


class ECP2PConnector(ECConnector):
    name = "ECP2PConnector"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, engine_id: str = "", max_bytes: int = 1 << 30,
                 ttl_s: float = 600.0, fetch_timeout_s: float = 5.0, faults: FaultConfig | None = None) -> None:
        super().__init__(faults)
        self.host = host
        self.requested_port = port
        self.port = 0
        self.engine_id = engine_id
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.fetch_timeout_s = fetch_timeout_s
        self._store: OrderedDict[str, _Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._socket: zmq.Socket | None = None

    # -- producer -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Only producers serve; consumers need no server."""
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if self.requested_port:
            self._socket.bind(f"tcp://{self.host}:{self.requested_port}")
            self.port = self.requested_port
        else:
            self.port = self._socket.bind_to_random_port(f"tcp://{self.host}")
        self._thread = threading.Thread(target=self._serve, name="pdserve-ec-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(2)
        self._ctx.destroy(linger=0)

    def save(self, mm_hash: str, output: torch.Tensor) -> ECSource:
        tensor = output.detach().to("cpu").contiguous()
        stored = _Stored(tensor, tensor_checksum(tensor), secrets.token_hex(16), time.monotonic() + self.ttl_s)
        with self._lock:
            old = self._store.pop(mm_hash, None)
            if old is not None:
                self._bytes -= _nbytes(old.tensor)
            self._store[mm_hash] = stored
            self._bytes += _nbytes(tensor)
            self._evict()
        self.stores += 1
        return self._params(mm_hash, stored)

    def holds(self, mm_hash: str) -> ECSource | None:
        with self._lock:
            stored = self._store.get(mm_hash)
            if stored is None or stored.expires_at <= time.monotonic():
                return None
            stored.expires_at = time.monotonic() + self.ttl_s
            self._store.move_to_end(mm_hash)
            return self._params(mm_hash, stored)

    def _params(self, mm_hash: str, stored: _Stored) -> ECSource:
        return ECSource(connector=self.name, num_embeds=stored.tensor.shape[0], checksum=stored.checksum,
                        host=self.host, port=self.port, engine_id=self.engine_id, token=stored.token)

    def _evict(self) -> None:
        now = time.monotonic()
        for mm_hash in list(self._store):
            stored = self._store[mm_hash]
            if self._bytes <= self.max_bytes and stored.expires_at > now:
                break
            del self._store[mm_hash]
            self._bytes -= _nbytes(stored.tensor)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(200):
                continue
            identity, message_id, body = self._socket.recv_multipart()
            self._socket.send_multipart([identity, message_id, encode(self._answer(body))])

    def _answer(self, body: bytes) -> ECData:
        try:
            request = decode(body)
        except ProtocolError as exc:
            return ECData(ok=False, error=str(exc))
        if not isinstance(request, ECFetch):
            return ECData(ok=False, error="expected an ec_fetch message")
        with self._lock:
            self._evict()
            stored = self._store.get(request.mm_hash)
        if stored is None:
            return ECData(ok=False, error=f"no encoder output for {request.mm_hash} (never made, or evicted)")
        if request.token != stored.token:
            return ECData(ok=False, error=f"wrong token for {request.mm_hash}")
        t = stored.tensor
        return ECData(ok=True, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                      data=t.view(-1).view(torch.uint8).numpy().tobytes(), checksum=stored.checksum)

    # -- consumer -------------------------------------------------------------------------------------------
    def _fetch(self, mm_hash: str, source: ECSource) -> tuple[torch.Tensor, int]:
        if source.host is None or source.port is None:
            raise ECLoadError(f"ec_transfer_params for {mm_hash} name no remote_host and remote_port")
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(f"tcp://{source.host}:{source.port}")
            socket.send_multipart([b"1", encode(ECFetch(mm_hash=mm_hash, token=source.token))])
            if not socket.poll(int(self.fetch_timeout_s * 1000)):
                raise ECLoadError(f"no answer from the encode instance within {self.fetch_timeout_s} s")
            _, body = socket.recv_multipart()
        finally:
            socket.close(0)
        reply = decode(body)
        if not isinstance(reply, ECData) or not reply.ok:
            raise ECLoadError(getattr(reply, "error", "") or "bad answer from the encode instance")
        tensor = torch.frombuffer(bytearray(reply.data), dtype=torch.uint8).view(DTYPES[reply.dtype])
        return tensor.view(*reply.shape), reply.checksum


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
