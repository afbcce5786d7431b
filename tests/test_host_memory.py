"""The engine's allocator tuning: the large temporaries of a forward pass, freed and allocated again step after step,
come back resident (no page faults), where glibc's defaults unmap them on free and fault every page in again.
Counted by the kernel, in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, resource
import torch
from pdserve.engine.host_memory import keep_freed_memory
applied = keep_freed_memory()
def step():  # a forward's pattern: overlapping temporaries of a few sizes, all above glibc's mmap thresholds
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(48 << 20, dtype=torch.uint8)
    y = torch.ones(96 << 20, dtype=torch.uint8)
    del x
    z = torch.ones(64 << 20, dtype=torch.uint8)
    del y, z
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults": [step() for _ in range(12)]}))
"""
STEP_PAGES = ((48 + 96 + 64) << 20) // 4096


def probe(tuning: str) -> dict:
    env = {**os.environ, "PDSERVE_MALLOC_TUNING": tuning}
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt and the fault counter are Linux/glibc's")
def test_a_steps_temporaries_are_reused_without_faulting_their_pages_in_again():
    tuned, default = probe("1"), probe("0")
    assert tuned["applied"] and not default["applied"]
    assert max(tuned["faults"][-3:]) < STEP_PAGES // 20  # settled: every temporary comes back resident
    assert min(default["faults"][-3:]) > STEP_PAGES // 2  # the control: glibc's defaults map them anew each step
