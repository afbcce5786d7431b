"""Data planes by name: every one has a CPU implementation. NIXL's is listed only where NIXL is installed."""

from __future__ import annotations

import importlib.util

from pdserve.kv_transfer.data_plane.base import DataPlane, DataPlaneError, PeerChannel
from pdserve.kv_transfer.data_plane.nixl import NixlDataPlane
from pdserve.kv_transfer.data_plane.nixl_agent import NIXL_INSTALL_HINT
from pdserve.kv_transfer.data_plane.shm import ShmDataPlane
from pdserve.kv_transfer.data_plane.tcp import TcpDataPlane


def _available() -> dict[str, type[DataPlane]]:
    planes: dict[str, type[DataPlane]] = {"shm": ShmDataPlane, "tcp": TcpDataPlane}
    if importlib.util.find_spec("nixl") is not None:  # an optional dependency (the `nixl` extra), loaded on use
        planes["nixl"] = NixlDataPlane
    return planes


DATA_PLANES: dict[str, type[DataPlane]] = _available()


def make_data_plane(name: str, host: str) -> DataPlane:
    cls = DATA_PLANES.get(name)
    if cls is None and name == "nixl":
        raise ValueError(f"the nixl data plane needs NIXL, which is not installed: {NIXL_INSTALL_HINT} (the "
                         "`nixl` meta package without --no-deps pulls CUDA torch)")
    if cls is None:
        raise ValueError(f"unknown data plane {name!r}; available: {', '.join(sorted(DATA_PLANES))}")
    return cls(host)


__all__ = ["DATA_PLANES", "NIXL_INSTALL_HINT", "DataPlane", "DataPlaneError", "PeerChannel", "make_data_plane"]
