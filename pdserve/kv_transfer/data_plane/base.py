"""The data plane: how KV block bytes move between instances, behind one interface.

A data plane allocates the instance's KV pool (shared memory needs to own it), describes how peers reach it,
serves peers where the plane needs a server, and opens channels to peers that read (pull) or write (push) whole
blocks or single layers of blocks. Authorisation is the caller's: a server asks ``authorize`` before it touches
a block.
"""

from __future__ import annotations

import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from pdserve.kv_transfer.data_plane.regions import (BlockRegions, DataPlaneError, byte_view, check_block_ids,
                                                    refuse_device_memory)

__all__ = ["DRAIN_S", "IN_FLIGHT_BOUND_S", "SOCKET_TIMEOUT_S", "Authorizer", "BlockRegions", "DataPlane",
           "DataPlaneError", "PeerChannel", "accept_until_stopped", "block_runs", "byte_view", "check_block_ids",
           "refuse_device_memory"]

# A transfer call gives up after SOCKET_TIMEOUT_S; a one-sided engine cannot cancel a transfer still moving
# then, so the call waits it out up to DRAIN_S more before it returns. Memory a peer may be moving bytes into is
# therefore settled at the latest IN_FLIGHT_BOUND_S after the peer's transfer started: its owner reuses it no
# sooner, unless the peer said earlier that nothing more will land.
SOCKET_TIMEOUT_S = 30.0
DRAIN_S = 30.0
IN_FLIGHT_BOUND_S = SOCKET_TIMEOUT_S + DRAIN_S

# (op, key, token, block_ids) -> None if allowed, else the reason it is refused. op is "read" or "write".
Authorizer = Callable[[str, str, str, list[int]], str | None]


class PeerChannel(ABC):
    @abstractmethod
    def read_blocks(self, key: str, token: str, remote_ids: list[int], local_ids: list[int]) -> int:
        """Copy the remote blocks into the local ones; returns bytes moved. Blocking."""

    @abstractmethod
    def write_blocks(self, key: str, token: str, local_ids: list[int], remote_ids: list[int],
                     layer: int | None = None) -> int:
        """Copy local blocks (or one layer of them) into the remote ones; returns bytes moved. Blocking."""

    def read_into(self, key: str, token: str, remote_ids: list[int], staged_ids: list[int],
                  staging: BlockRegions) -> int:
        """Copy the remote blocks' bytes as they lie into a staging area (another engine's layout, to be
        regrouped); returns bytes moved. Blocking. Only planes that copy bytes through `BlockRegions` can."""
        raise DataPlaneError("this data plane reads only into the local KV pool, not into a staging area")

    def write_from(self, key: str, token: str, staged_ids: list[int], remote_ids: list[int],
                   staging: BlockRegions, layer: int | None = None) -> int:
        """Copy staged blocks (or one layer of them), already in the peer's layout, into the remote ones; returns
        bytes moved. Blocking. Only planes that copy bytes through `BlockRegions` can."""
        raise DataPlaneError("this data plane writes only from the local KV pool, not from a staging area")

    def close(self) -> None:
        pass


class DataPlane(ABC):
    name: str = ""
    # Whether a peer's every write into this pool passes `authorize` first: the owner then knows when the last
    # write it let in started (shared memory's peer writes without asking).
    authorizes_writes: bool = True
    # Whether its channels implement `read_into` and `write_from` (transfers with another engine's layout, staged
    # to be regrouped).
    stages: bool = False

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.kv: torch.Tensor | None = None
        self.regions: BlockRegions | None = None  # where each block's bytes are, for the planes that copy bytes
        self.authorize: Authorizer = lambda op, key, token, ids: "no transfer agent attached"

    @abstractmethod
    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Allocate (zeroed) and keep the local KV pool."""

    def attach(self, kv: torch.Tensor) -> None:
        """Serve a pool another plane allocated (all planes of an instance share one pool)."""
        self.kv = kv
        self.regions = BlockRegions.from_pool(kv)

    def attach_regions(self, regions: BlockRegions) -> None:
        """Serve a cache laid out by another engine (vLLM's tensor per layer): only planes that copy opaque
        bytes per block can."""
        raise DataPlaneError(f"the {self.name} data plane serves only pdserve's own KV pool")

    def start(self, authorize: Authorizer) -> None:
        self.authorize = authorize

    def stop(self) -> None:
        pass

    @abstractmethod
    def local_info(self) -> dict[str, Any]:
        """Coordinates a peer needs to reach this pool; sent in the handshake."""

    @abstractmethod
    def connect(self, info: dict[str, Any]) -> PeerChannel:
        """A channel to the peer described by its handshake `info`."""


def accept_until_stopped(listener: socket.socket, stopping: threading.Event,
                         handle: Callable[[socket.socket], None]) -> None:
    """Accept connections (the listener has a short timeout, so `stopping` is noticed) and hand each over."""
    while not stopping.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        handle(conn)


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Pair up source and destination blocks into (src_start, dst_start, length) runs of consecutive ids.

    Pairs are taken in source order: freed blocks return to the pool tail first, so in steady state a
    request's blocks are often consecutive but descending, and sorting turns ~100 one-block copies into a few.
    """
    runs: list[tuple[int, int, int]] = []
    for s, d in sorted(zip(src, dst, strict=True)):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            start_s, start_d, n = runs[-1]
            runs[-1] = (start_s, start_d, n + 1)
        else:
            runs.append((s, d, 1))
    return runs
