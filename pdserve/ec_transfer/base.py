"""Encoder-cache (EC) connectors: how an encode instance's outputs reach the prefill/decode instances.

A producer (the encode instance) stores each item's encoder output under its mm_hash and describes where it
is (`ec_transfer_params[mm_hash]`); a consumer loads it. Consumers are optimistic: an item marked
remote is scheduled as a load with no probe, and a failed load is reported so the scheduler can roll back and
encode locally. Every output carries a checksum, so a damaged one fails rather than feeds the model garbage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import xxhash

from pdserve.ec_transfer.params import ECSource
from pdserve.kv_transfer.faults import FaultConfig, FaultInjector, InjectedFault

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ECLoadError(RuntimeError):
    pass


def tensor_checksum(tensor: torch.Tensor) -> int:
    t = tensor.contiguous()
    return xxhash.xxh3_64_intdigest(memoryview(t.view(-1).view(torch.uint8).numpy()))


class ECConnector(ABC):
    name = ""

    def __init__(self, faults: FaultConfig | None = None) -> None:
        self.faults = FaultInjector(faults or FaultConfig())
        self.stores = 0
        self.loads = 0
        self.load_failures = 0

    # -- producer -------------------------------------------------------------------------------------------
    @abstractmethod
    def save(self, mm_hash: str, output: torch.Tensor) -> ECSource:
        """Keep an encoder output; returns where it is (its entry in ec_transfer_params)."""

    def holds(self, mm_hash: str) -> ECSource | None:
        """Where an output already stored is (so the encoder need not run again), or None."""
        return None

    # -- consumer -------------------------------------------------------------------------------------------
    def load(self, mm_hash: str, source: ECSource) -> torch.Tensor:
        """Fetch and verify an output; raises on anything missing, refused or damaged."""
        try:
            if source.error is not None:
                raise ECLoadError(source.error)
            if self.faults.enabled:
                self.faults.before_transfer("read")
            output, checksum = self._fetch(mm_hash, source)
            if self.faults.enabled and self.faults.should_corrupt_blocks():
                output = output.clone()
                output.view(-1)[0] += 1.0
            expected = checksum if source.checksum is None else source.checksum
            if tensor_checksum(output) != expected:
                raise ECLoadError(f"encoder output {mm_hash} failed its checksum")
            num = source.num_embeds
            if num is not None and output.shape[0] != num:
                raise ECLoadError(f"encoder output {mm_hash} has {output.shape[0]} embeddings, expected {num}")
        except (ECLoadError, InjectedFault, OSError, KeyError, ValueError) as exc:
            self.load_failures += 1
            raise ECLoadError(str(exc)) from exc
        self.loads += 1
        return output

    @abstractmethod
    def _fetch(self, mm_hash: str, source: ECSource) -> tuple[torch.Tensor, int]:
        """The stored output and the checksum recorded with it."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {"counter pdserve:ec_stores": self.stores, "counter pdserve:ec_loads": self.loads,
                "counter pdserve:ec_load_failures": self.load_failures}
