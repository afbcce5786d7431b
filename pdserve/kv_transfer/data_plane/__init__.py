"""Data planes by name: every one has a CPU implementation. An optional engine's plane is listed only where the
engine is installed."""

from __future__ import annotations

import importlib
import importlib.util

from pdserve.kv_transfer.data_plane.base import DataPlane, DataPlaneError, PeerChannel
from pdserve.kv_transfer.data_plane.nixl_agent import NIXL_INSTALL_HINT
from pdserve.kv_transfer.data_plane.shm import ShmDataPlane
from pdserve.kv_transfer.data_plane.tcp import TcpDataPlane

# name -> (module, class, the engine's package, how to install the engine). Planes over a third-party transfer
# engine are optional extras; the hint is what an instance configured with one says when the engine is missing.
# NIXL's plane loads NIXL only when its first agent is made, so the package's presence is checked as well.
OPTIONAL_PLANES: dict[str, tuple[str, str, str, str]] = {
    "nixl": ("pdserve.kv_transfer.data_plane.nixl", "NixlDataPlane", "nixl",
             f"{NIXL_INSTALL_HINT} (the `nixl` meta package without --no-deps pulls CUDA torch)"),
    "mooncake": ("pdserve.kv_transfer.data_plane.mooncake", "MooncakeDataPlane", "mooncake",
                 "pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1, with libibverbs1 from the "
                 "system's packages"),
}


def _available() -> dict[str, type[DataPlane]]:
    planes: dict[str, type[DataPlane]] = {"shm": ShmDataPlane, "tcp": TcpDataPlane}
    for name, (module, cls, engine, _) in OPTIONAL_PLANES.items():
        if importlib.util.find_spec(engine) is None:
            continue
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
                         f"{OPTIONAL_PLANES[name][3]}")
    if cls is None:
        raise ValueError(f"unknown data plane {name!r}; available: {', '.join(sorted(DATA_PLANES))}")
    return cls(host)


__all__ = ["DATA_PLANES", "NIXL_INSTALL_HINT", "OPTIONAL_PLANES", "DataPlane", "DataPlaneError", "PeerChannel",
           "make_data_plane"]
