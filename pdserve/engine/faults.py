"""Engine fault injection, for drills and tests: off unless ``PDSERVE_ENGINE_FAULTS`` (JSON) is set.

Faults fire on a chosen token id, so a test picks exactly which request meets one:

    {"compute_fail_token": 4000}  the model step that computes a chunk holding token 4000 raises; the engine
                                  fails that step's requests and keeps serving
    {"step_crash_token": 4001}    the engine step raises after the scheduler took the model's results, leaving
                                  its state half-updated; the instance exits for its supervisor to restart it
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

from pdserve.engine.outputs import ScheduledRequest

ENV_VAR = "PDSERVE_ENGINE_FAULTS"


class InjectedEngineFault(RuntimeError):
    """A failure the fault injector made up (so logs say so)."""


@dataclass(frozen=True, slots=True)
class EngineFaults:
    compute_fail_token: int | None = None
    step_crash_token: int | None = None

    @classmethod
    def from_env(cls) -> EngineFaults:
        raw: dict[str, Any] = json.loads(os.environ.get(ENV_VAR) or "{}")
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown {ENV_VAR} keys {sorted(unknown)}")
        return cls(**raw)

    def check_compute(self, scheduled: list[ScheduledRequest]) -> None:
        _raise_on(self.compute_fail_token, scheduled, "model step")

    def check_step(self, scheduled: list[ScheduledRequest]) -> None:
        _raise_on(self.step_crash_token, scheduled, "engine step")


def _raise_on(token: int | None, scheduled: list[ScheduledRequest], where: str) -> None:
    if token is not None and any(token in s.token_ids for s in scheduled):
        raise InjectedEngineFault(f"injected fault in the {where} (token {token})")
