"""Fault injection for drills and tests: off unless configured, per instance.

Configured by ``kv_connector_extra_config.fault_injection`` or the ``PDSERVE_FAULTS`` environment variable
(JSON). Probabilities apply independently per message or per transfer; a seed makes a drill reproducible:

    {"seed": 1, "message_drop": 0.1, "message_delay": 0.2, "message_delay_s": 0.5, "message_duplicate": 0.1,
     "message_reorder": 0.1, "message_corrupt": 0.05, "read_fail": 0.1, "write_fail": 0.1, "read_delay_s": 1.0,
     "block_corrupt": 0.05, "step_delay_s": 0.01}
"""

from __future__ import annotations

import json
import os
import random
import threading
from dataclasses import dataclass, fields
from typing import Any

ENV_VAR = "PDSERVE_FAULTS"


class InjectedFault(RuntimeError):
    """A failure the fault injector made up (so logs say so)."""


@dataclass(frozen=True, slots=True)
class FaultConfig:
    seed: int | None = None
    message_drop: float = 0.0
    message_delay: float = 0.0
    message_delay_s: float = 0.0
    message_duplicate: float = 0.0
    message_reorder: float = 0.0
    message_corrupt: float = 0.0
    read_fail: float = 0.0
    write_fail: float = 0.0
    read_delay_s: float = 0.0
    write_delay_s: float = 0.0
    block_corrupt: float = 0.0
    block_fail: float = 0.0  # each block of a read or write is lost (left stale) with this probability
    step_delay_s: float = 0.0  # a slow instance: every engine step takes this much longer

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> FaultConfig:
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown fault_injection keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**raw)

    @property
    def enabled(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self) if f.name != "seed")


def resolve_fault_config(extra_config: dict[str, Any]) -> FaultConfig:
    """Config wins over the environment; both default to no faults at all."""
    if "fault_injection" in extra_config:
        return FaultConfig.from_dict(extra_config["fault_injection"])
    raw = os.environ.get(ENV_VAR)
    return FaultConfig.from_dict(json.loads(raw)) if raw else FaultConfig()


@dataclass(slots=True)
class MessageFate:
    drop: bool = False
    delay_s: float = 0.0
    duplicate: bool = False
    reorder: bool = False
    corrupt: bool = False


class FaultInjector:
    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._random = random.Random(config.seed)
        self._lock = threading.Lock()  # data-plane threads and the agent loop both roll dice
        self.injected: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def _roll(self, probability: float, kind: str) -> bool:
        if probability <= 0:
            return False
        with self._lock:
            hit = self._random.random() < probability
        if hit:
            self.injected[kind] = self.injected.get(kind, 0) + 1
        return hit

    def message_fate(self) -> MessageFate:
        c = self.config
        if not c.enabled:
            return MessageFate()
        return MessageFate(
            drop=self._roll(c.message_drop, "message_drop"),
            delay_s=c.message_delay_s if self._roll(c.message_delay, "message_delay") else 0.0,
            duplicate=self._roll(c.message_duplicate, "message_duplicate"),
            reorder=self._roll(c.message_reorder, "message_reorder"),
            corrupt=self._roll(c.message_corrupt, "message_corrupt"),
        )

    def corrupt_payload(self, payload: bytes) -> bytes:
        """Flip bytes so the message no longer decodes (or decodes into nonsense the receiver must reject)."""
        data = bytearray(payload)
        for i in range(0, len(data), max(1, len(data) // 4)):
            data[i] ^= 0xFF
        return bytes(data)

    def before_transfer(self, op: str) -> float:
        """Seconds to stall before a read or write; raises InjectedFault to fail it."""
        c = self.config
        if op == "read" and self._roll(c.read_fail, "read_fail"):
            raise InjectedFault("injected block read failure")
        if op == "write" and self._roll(c.write_fail, "write_fail"):
            raise InjectedFault("injected block write failure")
        return c.read_delay_s if op == "read" else c.write_delay_s

    def step_delay(self) -> float:
        return self.config.step_delay_s

    def should_corrupt_blocks(self) -> bool:
        return self._roll(self.config.block_corrupt, "block_corrupt")

    def lost_blocks(self, block_ids: list[int]) -> set[int]:
        """Blocks of a transfer that the injector says never arrived."""
        return {b for b in block_ids if self._roll(self.config.block_fail, "block_fail")}

    def damage(self, regions, block_ids: list[int], lost: set[int]) -> None:
        """Apply injected transit damage to received blocks (a `BlockRegions`): lost ones zeroed, maybe one
        corrupted (the start of its bytes overwritten)."""
        for b in lost:
            regions.fill(b, 0)
        if block_ids and self.should_corrupt_blocks():
            regions.fill(block_ids[len(block_ids) // 2], 0xA5, max(1, regions.block_bytes // 64))

