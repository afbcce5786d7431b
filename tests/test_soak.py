"""The soak benchmark for a few seconds: every protocol through the gateway, faults injected, client aborts.

bench/soak.py exits non-zero on a wrong answer, a hang, or anything left held on any instance after the drain, so
this short run guards the same invariants the 10-minute run in docs/benchmarks.md records.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_short_soak_is_clean(tmp_path):
    summary = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--duration", "12", "--warmup", "8", "--concurrency", "4",
         "--no-progress", "--json", str(summary)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    s = json.loads(summary.read_text())
    assert s["ok"] and not s["failures"]
    assert s["completed"] > 0
