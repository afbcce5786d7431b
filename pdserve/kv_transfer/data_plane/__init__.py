"""Data planes by name: every one has a CPU implementation. An optional engine's plane is listed only where the
engine is installed (its module imports)."""

from __future__ import annotations

import importlib

from pdserve.kv_transfer.data_plane.base import DataPlane, DataPlaneError, PeerChannel
from pdserve.kv_transfer.data_plane.shm import ShmDataPlane
from pdserve.kv_transfer.data_plane.tcp import TcpDataPlane

# name -> (module, class, how to install its engine). Planes over a third-party transfer engine are optional
# extras; the hint is what an instance configured with one says when the engine is missing.
OPTIONAL_PLANES: dict[str, tuple[str, str, str]] = {
    "nixl": ("pdserve.kv_transfer.data_plane.nixl", "NixlDataPlane",
             "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1 (the `nixl` meta package without --no-deps pulls "
             "CUDA torch)"),
    "mooncake": ("pdserve.kv_transfer.data_plane.mooncake", "MooncakeDataPlane",
                 "pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1, with libibverbs1 from the "
                 "system's packages"),
}
NIXL_INSTALL_HINT = OPTIONAL_PLANES["nixl"][2]


def _available() -> dict[str, type[DataPlane]]:
    planes: dict[str, type[DataPlane]] = {"shm": ShmDataPlane, "tcp": TcpDataPlane}
    for name, (module, cls, _) in OPTIONAL_PLANES.items():
        try:
            planes[name] = getattr(importlib.import_module(module), cls)
        except ImportError:  # an optional dependency (the extra of the same name) or a system library it needs
            continue
    return planes


DATA_PLANES: dict[str, type[DataPlane]] = _available()


def make_data_plane(name: str, host: str) -> DataPlane:
    cls = DATA_PLANES.get(name)
    if cls is None and name in OPTIONAL_PLANES:
        raise ValueError(f"the {name} data plane needs its transfer engine, which is not installed: "
                         f"{OPTIONAL_PLANES[name][2]}")
    if cls is None:
        raise ValueError(f"unknown data plane {name!r}; available: {', '.join(sorted(DATA_PLANES))}")
    return cls(host)


__all__ = ["DATA_PLANES", "NIXL_INSTALL_HINT", "OPTIONAL_PLANES", "DataPlane", "DataPlaneError", "PeerChannel",
           "make_data_plane"]
