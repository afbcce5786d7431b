"""Same-host shared memory: a peer on this host copies blocks itself, one-sided, and is refused across hosts.

pdserve's own pool lives in a memfd, which the owner hands to a peer once over a Unix socket; the peer maps it.
A memfd has no name in /dev/shm, so when the last process holding it exits (even by SIGKILL) the kernel frees
it: nothing can leak. A cache another engine allocated (vLLM's tensor per layer, ordinary process memory) cannot
be handed over that way: there the socket only proves the peer is on this host and names its process, and
blocks move by cross-memory attach (`cma.py`), the kernel copying straight between the two processes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import socket
import struct
import threading
from typing import Any

import torch

from pdserve.kv_transfer.data_plane.base import (BlockRegions, DataPlane, DataPlaneError, PeerChannel,
                                                 accept_until_stopped, block_runs, check_block_ids,
                                                 refuse_device_memory)
from pdserve.kv_transfer.data_plane.cma import CmaPeer, Probe, owner_info, peer_pid

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def host_identity() -> str:
    """Distinguishes machines (and boots): shared memory only works between processes that share it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()}/{boot}"


def _same_user(conn: socket.socket) -> bool:
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid == os.getuid()


def map_pool(fd: int, shape: list[int], dtype: torch.dtype) -> tuple[mmap.mmap, torch.Tensor]:
    size = os.fstat(fd).st_size
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(*shape)
    return mapping, tensor


# Runs up to this size are copied with one libc memmove each; longer ones with torch's copy, which spreads a big
# copy over every thread and streams faster than memmove (docs/benchmarks.md §2).
_MEMMOVE_MAX_BYTES = 1 << 20


def _copy_block_runs(dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    """Copy runs of whole blocks (src_start, dst_start, n) between two contiguous CPU pools of the same layout.

    A small model's block is tens of KiB, and a torch ``copy_`` call costs about as long as copying that much, so
    scattered ids ran at half the memcpy rate through torch; a memmove (ctypes releases the GIL) has almost no
    call cost. The ids are bounds-checked by the caller: a wrong one here would be a wild write.
    """
    block = dst[0].numel() * dst.element_size()
    dst_base, src_base = dst.data_ptr(), src.data_ptr()
    move = ctypes.memmove
    for s, d, n in runs:
        if n * block <= _MEMMOVE_MAX_BYTES:
            move(dst_base + d * block, src_base + s * block, n * block)
        else:
            dst[d:d + n].copy_(src[s:s + n])


def _raw_copyable(*pools: torch.Tensor) -> bool:
    return all(p.device.type == "cpu" and p.is_contiguous() for p in pools)


class ShmPeer(PeerChannel):
    """D's view of one peer's pool. Copies run on transfer threads while the agent may close the channel (a
    failed or timed-out load drops its peer), so each copy takes its own reference to the mapped pool and close()
    only drops ours: the memory is unmapped when the last tensor over it is gone, never under a running copy."""

    def __init__(self, remote: torch.Tensor, local: torch.Tensor) -> None:
        # `remote` keeps its mmap object alive (torch.frombuffer holds it), and that unmaps when released.
        self.remote: torch.Tensor | None = remote
        self.local = local
        self.raw = _raw_copyable(remote, local) and remote[0].shape == local[0].shape and remote.dtype == local.dtype

    def _pool(self) -> torch.Tensor:
        remote = self.remote
        if remote is None:
            raise DataPlaneError("the shared-memory channel to this peer was closed")
        return remote

    def read_blocks(self, key: str, token: str, remote_ids: list[int], local_ids: list[int]) -> int:
        remote, local = self._pool(), self.local
        check_block_ids(remote_ids, remote.shape[0])
        check_block_ids(local_ids, local.shape[0])
        runs = block_runs(remote_ids, local_ids)
        if self.raw:
            _copy_block_runs(local, remote, runs)
        else:
            for src, dst, n in runs:
                local[dst:dst + n].copy_(remote[src:src + n])
        return len(remote_ids) * local[0].numel() * local.element_size()

    def write_blocks(self, key: str, token: str, local_ids: list[int], remote_ids: list[int],
                     layer: int | None = None) -> int:
        remote, local = self._pool(), self.local
        check_block_ids(remote_ids, remote.shape[0])
        check_block_ids(local_ids, local.shape[0])
        runs = block_runs(local_ids, remote_ids)
        if layer is None and self.raw:
            _copy_block_runs(remote, local, runs)
            return len(local_ids) * local[0].numel() * local.element_size()
        moved = 0
        for src, dst, n in runs:
            if layer is None:
                remote[dst:dst + n].copy_(local[src:src + n])
                moved += n * local[0].numel()
            else:
                remote[dst:dst + n, layer].copy_(local[src:src + n, layer])
                moved += n * local[0, layer].numel()
        return moved * local.element_size()

    def close(self) -> None:
        # No mapping.close(): it would unmap even while a copy on another thread still reads the pool (torch's
        # frombuffer keeps the mmap object, not a buffer export, so nothing stops it) and crash the process.
        self.remote = None


class ShmDataPlane(DataPlane):
    name = "shm"
    authorizes_writes = False

    def __init__(self, host: str = "127.0.0.1") -> None:
        super().__init__(host)
        self.fd: int | None = None
        self.mapping: mmap.mmap | None = None
        # Abstract-namespace socket: no file to clean up after a crash.
        self.socket_name = f"pdserve-kv-{os.getpid()}-{secrets.token_hex(6)}"
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._probe: Probe | None = None  # set when serving another engine's cache by cross-memory attach

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.fd = os.memfd_create("pdserve-kv", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self.mapping, kv = map_pool(self.fd, list(shape), dtype)
        # Touch every page now (they read as zeros anyway): otherwise the first loads into a fresh pool pay
        # the page faults, measured at 26 ms instead of 1.4 ms for a 2k-token prompt.
        kv.zero_()
        self.attach(kv)
        return kv

    def attach_regions(self, regions: BlockRegions) -> None:
        """Another engine's cache, in this process's memory: peers on this host copy it by cross-memory attach."""
        refuse_device_memory(self.name, regions.device)
        self.regions = regions
        self._probe = Probe()

    def start(self, authorize) -> None:
        super().start(authorize)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + self.socket_name)
        listener.listen(64)
        listener.settimeout(0.2)
        self._listener = listener
        self._thread = threading.Thread(target=self._serve_fd, name="pdserve-shm-fd", daemon=True)
        self._thread.start()

    def _serve_fd(self) -> None:
        accept_until_stopped(self._listener, self._stopping, self._hand_over)

    def _hand_over(self, conn: socket.socket) -> None:
        with conn:
            if not _same_user(conn):
                return  # the abstract socket is reachable by every local user; the KV is only for ours
            try:
                if self.fd is None:
                    conn.sendall(b"cma")  # the peer reads our pid off the socket and our memory directly
                else:
                    socket.send_fds(conn, [b"kv"], [self.fd])
            except OSError:
                pass

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        if self._thread is not None:
            self._thread.join(2)

    def local_info(self) -> dict[str, Any]:
        info = {"socket": self.socket_name, "host_id": host_identity()}
        if self._probe is not None and self.regions is not None:
            return {**info, "cma": owner_info(self.regions, self._probe)}
        assert self.kv is not None
        return {**info, "shape": list(self.kv.shape), "dtype": str(self.kv.dtype).removeprefix("torch.")}

    def connect(self, info: dict[str, Any]) -> PeerChannel:
        if info.get("host_id") != host_identity():
            raise DataPlaneError("the shm data plane needs both instances on one host; use the tcp data plane")
        if self.regions is None:
            raise DataPlaneError("the local KV pool is not allocated")
        if "cma" not in info and self.kv is None:
            raise DataPlaneError("the peer shares pdserve's own KV pool, which this instance's cache cannot map")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(5)
            try:
                conn.connect("\0" + info["socket"])
                greeting, fds, _, _ = socket.recv_fds(conn, 16, 1)
                if "cma" in info:
                    for fd in fds:
                        os.close(fd)
                    if greeting != b"cma":
                        raise DataPlaneError("the peer did not admit us to its memory (another user?)")
                    return CmaPeer(peer_pid(conn), info["cma"], self.regions)
            except OSError as exc:
                raise DataPlaneError(f"cannot reach the peer's shared memory: {exc}") from exc
        if not fds:
            raise DataPlaneError("the peer sent no memory handle")
        try:
            _, remote = map_pool(fds[0], info["shape"], _DTYPES[info["dtype"]])
        finally:
            os.close(fds[0])  # the mapping keeps the memory alive
        if remote[0].shape != self.kv[0].shape or remote.dtype != self.kv.dtype:
            raise DataPlaneError("the peer's KV block layout differs from ours")
        return ShmPeer(remote, self.kv)
