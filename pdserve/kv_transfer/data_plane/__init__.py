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


BUILT_IN_PLANES: dict[str, type[DataPlane]] = {"shm": ShmDataPlane, "tcp": TcpDataPlane}


def _installed() -> tuple[str, ...]:
    return (*BUILT_IN_PLANES, *(name for name, (_, _, engine, _) in OPTIONAL_PLANES.items()
                                if importlib.util.find_spec(engine) is not None))


# The planes this installation offers. An optional plane's module is imported by the first instance that makes
# one, not here: Mooncake's engine starts five threads as its module loads, which every process importing the
# registry would then carry (a fork server must carry none), where most instances never use it.
DATA_PLANES: tuple[str, ...] = _installed()


def make_data_plane(name: str, host: str) -> DataPlane:
    if name in BUILT_IN_PLANES:
        return BUILT_IN_PLANES[name](host)
    if name not in OPTIONAL_PLANES:
        raise ValueError(f"unknown data plane {name!r}; available: {', '.join(sorted(DATA_PLANES))}")
    module, cls, _, hint = OPTIONAL_PLANES[name]
    if name not in DATA_PLANES:
        raise ValueError(f"the {name} data plane needs its transfer engine, which is not installed: {hint}")
    try:
        plane: type[DataPlane] = getattr(importlib.import_module(module), cls)
    except ImportError as exc:  # the engine is there but a system library it links is not
        raise ValueError(f"the {name} data plane cannot load its transfer engine ({exc}): {hint}") from exc
    return plane(host)


__all__ = ["DATA_PLANES", "NIXL_INSTALL_HINT", "OPTIONAL_PLANES", "DataPlane", "DataPlaneError", "PeerChannel",
           "make_data_plane"]
