"""Shared storage in vLLM ECExampleConnector's layout: `<path>/<mm_hash>/encoder_cache.safetensors`, one tensor
named `ec_cache` (pdserve adds its checksum to the file's metadata). Survives restarts; any instance that
mounts the same path can read it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdserve.ec_transfer.base import ECConnector, ECLoadError, tensor_checksum
from pdserve.ec_transfer.params import ECSource
from pdserve.kv_transfer.faults import FaultConfig

TENSOR_NAME = "ec_cache"
FILE_NAME = "encoder_cache.safetensors"


class ECStorageConnector(ECConnector):
    name = "ECStorageConnector"

    def __init__(self, shared_storage_path: str | Path, faults: FaultConfig | None = None) -> None:
        super().__init__(faults)
        self.root = Path(shared_storage_path)

    def path_of(self, mm_hash: str) -> Path:
        if not mm_hash or "/" in mm_hash or mm_hash.startswith("."):
            raise ECLoadError(f"invalid mm_hash {mm_hash!r}")
        return self.root / mm_hash / FILE_NAME

    def save(self, mm_hash: str, output: torch.Tensor) -> ECSource:
        path = self.path_of(mm_hash)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensor = output.detach().to("cpu").contiguous()
        checksum = tensor_checksum(tensor)
        # Written to a temporary name and renamed: a reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        save_file({TENSOR_NAME: tensor}, tmp, metadata={"checksum": str(checksum)})
        os.replace(tmp, path)
        self.stores += 1
        return self._params(mm_hash, tensor, checksum)

    def holds(self, mm_hash: str) -> ECSource | None:
        path = self.path_of(mm_hash)
        if not path.is_file():
            return None
        try:
            tensor, checksum = self._fetch(mm_hash, ECSource())
        except (ECLoadError, OSError, ValueError):
            return None
        return self._params(mm_hash, tensor, checksum)

    def _params(self, mm_hash: str, tensor: torch.Tensor, checksum: int) -> ECSource:
        return ECSource(connector=self.name, num_embeds=tensor.shape[0], checksum=checksum)

    def _fetch(self, mm_hash: str, source: ECSource) -> tuple[torch.Tensor, int]:
        path = self.path_of(mm_hash)
        if not path.is_file():
            raise ECLoadError(f"no stored encoder output for {mm_hash}")
        try:
            with safe_open(str(path), framework="pt") as f:
                checksum = int((f.metadata() or {}).get("checksum", -1))
                return f.get_tensor(TENSOR_NAME), checksum
        except Exception as exc:  # noqa: BLE001 - a damaged file is a failed load, whatever safetensors raises
            raise ECLoadError(f"stored encoder output for {mm_hash} is unreadable: {exc}") from exc
