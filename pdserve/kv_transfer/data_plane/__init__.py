"""Data planes by name: every one has a CPU implementation."""

from __future__ import annotations

from pdserve.kv_transfer.data_plane.base import DataPlane, DataPlaneError, PeerChannel
from pdserve.kv_transfer.data_plane.shm import ShmDataPlane
from pdserve.kv_transfer.data_plane.tcp import TcpDataPlane

DATA_PLANES: dict[str, type[DataPlane]] = {"shm": ShmDataPlane, "tcp": TcpDataPlane}


def make_data_plane(name: str, host: str) -> DataPlane:
    cls = DATA_PLANES.get(name)
    if cls is None:
        raise ValueError(f"unknown data plane {name!r}; available: {', '.join(sorted(DATA_PLANES))}")
    return cls(host)


__all__ = ["DATA_PLANES", "DataPlane", "DataPlaneError", "PeerChannel", "make_data_plane"]
