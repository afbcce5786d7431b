"""The soak: every protocol through the gateway, faults injected, client aborts, every answer checked.

tests/soak/run.py exits non-zero on a wrong answer, a hang, anything left held on any instance after the drain, or an
instance whose RSS grew by more than 25 % from the end of warm-up to the end.
By default it runs a few seconds (what `make test` runs); `PDSERVE_SOAK_S=600` runs the ten-minute soak that
docs/benchmarks.md records, and `PDSERVE_SOAK_OUT=DIR` keeps its JSON summary and every process's log there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHORT_S = 12.0
DURATION_S = float(os.environ.get("PDSERVE_SOAK_S", SHORT_S))


@pytest.mark.slow
@pytest.mark.timeout(DURATION_S + 700)  # startup, warm-up and drain on top of the load
def test_soak_is_clean(tmp_path):
    duration = DURATION_S
    out = Path(os.environ.get("PDSERVE_SOAK_OUT", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "soak.json"
    short = duration <= SHORT_S
    cmd = [sys.executable, str(ROOT / "tests" / "soak" / "run.py"), "--duration", str(duration),
           "--json", str(summary), "--log-dir", str(out / "logs")]
    # A short run keeps the load light so it fits in `make test`; a long one uses the soak's own defaults.
    cmd += ["--warmup", "8", "--concurrency", "4", "--no-progress"] if short else []
    run = subprocess.run(cmd, capture_output=short, text=True, timeout=duration + 600, cwd=ROOT)
    assert run.returncode == 0, (run.stdout or "")[-4000:] + (run.stderr or "")[-4000:]
    s = json.loads(summary.read_text())
    assert s["ok"] and not s["failures"]
    assert s["completed"] > 0
