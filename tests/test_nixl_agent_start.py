"""What starting a NIXL agent does to its process: UCX's memory events stay off unless the deployment asks for them.

With them on, UCX rewrites the first instructions of libc's `mmap` (and its family) as the agent starts, spinning on
sched_yield meanwhile: most of an agent's start, and all of it system CPU. Each case runs in a fresh interpreter,
since UCX reads its settings once per process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kv_transfer.data_plane import DATA_PLANES

ROOT = Path(__file__).resolve().parent.parent

# Prints libc's mmap's first bytes before and after an agent starts, and the setting UCX then read.
START_AGENT = """
import ctypes, os
from pdserve.kv_transfer.data_plane.nixl_agent import NixlAgent
mmap = ctypes.cast(ctypes.CDLL(None).mmap, ctypes.c_void_p).value
before = ctypes.string_at(mmap, 16).hex()
agent = NixlAgent("start")
print(before, ctypes.string_at(mmap, 16).hex(), os.environ.get("UCX_MEM_EVENTS", "unset"))
"""


def start_agent(**env: str) -> tuple[str, str, str]:
    if "nixl" not in DATA_PLANES:
        pytest.fail("NIXL is not installed")
    base = {k: v for k, v in os.environ.items() if k != "UCX_MEM_EVENTS"}
    out = subprocess.run([sys.executable, "-c", START_AGENT], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**base, "PYTHONPATH": str(ROOT), **env}, check=True)
    before, after, setting = out.stdout.split()
    return before, after, setting


def test_an_agent_leaves_libcs_mmap_as_it_was():
    before, after, setting = start_agent()
    assert setting == "no"
    assert after == before, "UCX patched mmap: its memory events are on"


def test_a_deployment_that_wants_memory_events_keeps_them():
    before, after, setting = start_agent(UCX_MEM_EVENTS="yes")
    assert setting == "yes"
    assert after != before, "UCX left mmap alone with its memory events on (the check above would prove nothing)"
