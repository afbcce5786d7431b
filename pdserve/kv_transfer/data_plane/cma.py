"""Cross-memory attach: copying blocks straight between two processes' memory on one host (what UCX's `cma`
transport does), for caches that are ordinary process memory, such as vLLM's tensor per layer.

The reader calls `process_vm_readv` (the writer `process_vm_writev`) with the owner's pid and the addresses the
owner published in its handshake: one copy, kernel to kernel, with no staging buffer and no work in the owner.
The kernel allows it only to a process that may ptrace the owner (same user, and Yama's ptrace_scope 0, or
CAP_SYS_PTRACE); where that is refused, connecting fails and `auto` moves on to the next plane.

The pid is never taken from what the owner says: the reader learns it from the owner's Unix socket
(SO_PEERCRED, translated into the reader's pid namespace), and every read also copies a random probe the owner
keeps in its memory, in the same system call as the blocks: a pid that names another process (another pid
namespace, or a reused pid after the owner died) fails the read instead of copying a stranger's memory.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pdserve.kv_transfer.data_plane.base import (BlockRegions, DataPlaneError, PeerChannel, block_runs,
                                                 check_block_ids)

PROBE_BYTES = 16
# The kernel's limit on iovecs per call (UIO_MAXIOV); one remote slot is kept for the probe.
_MAX_IOV = 1024


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _syscalls() -> tuple[Any, Any]:
    """libc's process_vm_readv and process_vm_writev (ctypes releases the GIL while they copy)."""
    libc = ctypes.CDLL(None, use_errno=True)
    calls = (libc.process_vm_readv, libc.process_vm_writev)
    for call in calls:
        call.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                         ctypes.c_ulong, ctypes.c_ulong]
        call.restype = ctypes.c_ssize_t
    return calls


class Probe:
    """The owner's side: random bytes at a fixed address that a reader copies to prove whose memory it reads."""

    def __init__(self) -> None:
        self.nonce = secrets.token_bytes(PROBE_BYTES)
        self._buffer = ctypes.create_string_buffer(self.nonce, PROBE_BYTES)

    def info(self) -> dict[str, Any]:
        return {"address": ctypes.addressof(self._buffer), "nonce": self.nonce.hex()}


def owner_info(regions: BlockRegions, probe: Probe) -> dict[str, Any]:
    """What a same-host reader needs to find each block in the owner's memory."""
    return {"layers": [list(extent) for extent in regions.layer_extents()], "layer_bytes": regions.layer_bytes,
            "num_blocks": regions.num_blocks, "probe": probe.info()}


def peer_pid(conn: socket.socket) -> int:
    """The pid of the process at the other end of a connected Unix socket, as this process's namespace numbers it."""
    pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if pid <= 0:  # the owner lives in a pid namespace this one cannot see
        raise DataPlaneError("the peer's process is not visible from here")
    return pid


@dataclass(frozen=True, slots=True)
class _Remote:
    pid: int
    layers: list[tuple[int, int]]  # (address, stride) per layer
    layer_bytes: int
    num_blocks: int
    probe_address: int
    nonce: bytes


def _error(what: str, code: int) -> DataPlaneError:
    if code == errno.ESRCH:
        return DataPlaneError(f"cannot {what} the peer's memory: its process is gone")
    if code == errno.EPERM:
        return DataPlaneError(f"not permitted to {what} the peer's memory (cross-memory attach needs the same user "
                              "and kernel.yama.ptrace_scope 0, or CAP_SYS_PTRACE); use the tcp data plane")
    return DataPlaneError(f"cannot {what} the peer's memory: {os.strerror(code)}")


class CmaPeer(PeerChannel):
    """A channel to a same-host peer whose KV lives in its own process memory. Blocking; thread-safe (each
    call builds its own vectors)."""

    def __init__(self, pid: int, info: dict[str, Any], local: BlockRegions) -> None:
        layers = [(int(address), int(stride)) for address, stride in info["layers"]]
        if len(layers) != local.num_layers or int(info["layer_bytes"]) != local.layer_bytes:
            raise DataPlaneError("the peer's KV block layout differs from ours")
        probe = info["probe"]
        self.remote = _Remote(pid, layers, local.layer_bytes, int(info["num_blocks"]), int(probe["address"]),
                              bytes.fromhex(probe["nonce"]))
        self.local = local
        self._readv, self._writev = _syscalls()
        self.check_identity()

    def check_identity(self) -> None:
        """Copy the probe alone: the peer is the process that published it, and this process may read it."""
        self._copy(True, [], [])

    def read_blocks(self, key: str, token: str, remote_ids: list[int], local_ids: list[int]) -> int:
        local, remote = self._vectors(remote_ids, local_ids, None)
        self._copy(True, local, remote)
        return self.local.size(local_ids, None)

    def write_blocks(self, key: str, token: str, local_ids: list[int], remote_ids: list[int],
                     layer: int | None = None) -> int:
        local, remote = self._vectors(remote_ids, local_ids, layer)
        self.check_identity()  # a write cannot carry the probe: check it first
        self._copy(False, local, remote)
        return self.local.size(local_ids, layer)

    def _vectors(self, remote_ids: list[int], local_ids: list[int], layer: int | None
                 ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(local, remote) (address, length) spans in matching order, adjacent blocks of a layer merged."""
        check_block_ids(remote_ids, self.remote.num_blocks)
        check_block_ids(local_ids, self.local.num_blocks)
        if layer is not None and not 0 <= layer < self.local.num_layers:
            raise DataPlaneError(f"layer {layer} outside [0, {self.local.num_layers})")
        size, runs = self.local.layer_bytes, block_runs(remote_ids, local_ids)
        local_extents = self.local.layer_extents()
        local: list[tuple[int, int]] = []
        remote: list[tuple[int, int]] = []
        for index in range(len(local_extents)) if layer is None else (layer,):
            (r_base, r_stride), (l_base, l_stride) = self.remote.layers[index], local_extents[index]
            merge = r_stride == size and l_stride == size
            for r, loc, n in runs:
                for i in ((0,) if merge else range(n)):
                    length = n * size if merge else size
                    remote.append((r_base + (r + i) * r_stride, length))
                    local.append((l_base + (loc + i) * l_stride, length))
        return local, remote

    def _copy(self, reading: bool, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> None:
        """Copy in batches of at most the kernel's iovec limit; reads carry the probe in each batch."""
        call, what = (self._readv, "read") if reading else (self._writev, "write")
        seen = ctypes.create_string_buffer(PROBE_BYTES)  # per call: channels are shared by transfer threads
        for local_part, remote_part in _batches(local, remote, _MAX_IOV - 1):
            if reading:
                local_part = [*local_part, (ctypes.addressof(seen), PROBE_BYTES)]
                remote_part = [*remote_part, (self.remote.probe_address, PROBE_BYTES)]
            expected = sum(length for _, length in local_part)
            moved = call(self.remote.pid, _array(local_part), len(local_part), _array(remote_part),
                         len(remote_part), 0)
            if moved < 0:
                raise _error(what, ctypes.get_errno())
            if moved != expected:
                raise DataPlaneError(f"cannot {what} the peer's memory: {moved} of {expected} bytes copied")
            if reading and seen.raw != self.remote.nonce:
                raise DataPlaneError("the process behind the peer's pid is not the peer (its probe differs)")

    def close(self) -> None:
        """Nothing is mapped or held: a copy in flight on another thread simply finishes or fails."""


def _batches(local: list[tuple[int, int]], remote: list[tuple[int, int]], size: int
             ) -> Iterator[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
    if not local:
        yield [], []
    for start in range(0, len(local), size):
        yield local[start:start + size], remote[start:start + size]


def _array(spans: list[tuple[int, int]]) -> Any:
    return (_Iovec * max(1, len(spans)))(*[_Iovec(address, length) for address, length in spans])
