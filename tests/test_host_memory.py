"""The engine's allocator tuning: a large block freed and allocated again reuses resident pages (no page faults),
where glibc's defaults unmap it on free and fault every page in again. Counted by the kernel, in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, resource, sys
import torch
from pdserve.engine.host_memory import keep_freed_memory
applied = keep_freed_memory()
def faults_of_a_touched_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB: above any mmap threshold glibc picks on its own
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_a_touched_block(), faults_of_a_touched_block()  # warm: torch's first-use allocations settle
print(json.dumps({"applied": applied, "faults": [faults_of_a_touched_block() for _ in range(3)]}))
"""
PAGES = (64 << 20) // 4096


def probe(tuning: str) -> dict:
    env = {**os.environ, "PDSERVE_MALLOC_TUNING": tuning}
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt and the fault counter are Linux/glibc's")
def test_a_freed_block_is_reused_without_faulting_its_pages_in_again():
    tuned, default = probe("1"), probe("0")
    assert tuned["applied"] and not default["applied"]
    assert max(tuned["faults"]) < PAGES // 20  # the 64 MiB comes back resident
    assert min(default["faults"]) > PAGES // 2  # the control: glibc's defaults map it anew each time
