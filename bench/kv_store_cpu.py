"""Where a kv_store run's CPU goes: seconds of CPU of each process a mode runs (its instances, the store's servers)
and, inside the instances, of each of their threads by name (the engine's, the store tier's writer and reader, the
HTTP front's main thread, the rest), read from /proc: nothing in the product is patched or asked.

Python 3.11 gives its threads no OS names (every /proc/<pid>/task/<tid>/comm says "python"), so the threads are
named by one `py-spy dump --json` per instance (its `os_thread_id` and `thread_name`), taken when the split is
reported: the tier's threads live as long as the instance, so their ids are those the /proc readings saw. Without
py-spy (a diagnostic, not a dependency: `pip install -e '.[profile]'`) the threads are not split, the processes
still are.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness as H
from proc_cpu import box_busy_s, thread_seconds

# A thread's name prefix (ThreadPoolExecutor appends "_<n>") as the split reports it; the first that matches wins.
THREADS = (("pdserve-kv-store-write", "store writer"), ("pdserve-kv-store-read", "store reader"),
           ("pdserve-engine", "engine"), ("MainThread", "HTTP front (main)"))
OTHER = "other (unnamed: the store's client library, ZMQ, torch; named pdserve helpers)"


def find_py_spy(given: str | None) -> str | None:
    if given:
        return given
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def thread_names(py_spy: str | None, pid: int) -> dict[int, str]:
    """{os thread id: Python thread name} of a live Python process ({} without py-spy or when it fails)."""
    if py_spy is None:
        return {}
    try:
        out = subprocess.run([py_spy, "dump", "--json", "--pid", str(pid)], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        return {int(t["os_thread_id"]): t.get("thread_name") or "" for t in json.loads(out) if t.get("os_thread_id")}
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError):
        return {}


class CpuSplit:
    """CPU seconds per process group (label -> pids) and per instance thread, between `mark()` and `read()`;
    `add()` sums several measured spans (one per round)."""

    def __init__(self, instances: list[int], stores: dict[str, list[int]]) -> None:
        self.instances = [p for root in instances for p in H.descendants(root)]
        self.stores = stores
        self.total: dict[str, Any] = {"wall_s": 0.0, "processes": {}, "by_tid": {}}
        self._mark: tuple[float, dict[str, float], dict[tuple[int, int], float]] | None = None

    def _read(self) -> tuple[dict[str, float], dict[tuple[int, int], float]]:
        by_tid = {(pid, tid): s for pid in self.instances for tid, s in thread_seconds(pid).items()}
        procs = {"instances": sum(by_tid.values()), "bench client": sum(os.times()[:2])}
        for label, pids in self.stores.items():
            procs[label] = sum(H.cpu_seconds(p) for p in pids)
        # Everything else the box ran (the other modes' idle instances, anyone else's work): a disturbed span
        # shows here, and the split's figures are then suspect.
        procs["others"] = box_busy_s() - sum(procs.values())
        return procs, by_tid

    def mark(self) -> None:
        self._mark = (time.monotonic(), *self._read())

    def add(self) -> None:
        """The span since `mark()` into the totals."""
        assert self._mark is not None
        t0, procs0, tids0 = self._mark
        procs1, tids1 = self._read()
        self.total["wall_s"] += time.monotonic() - t0
        for label, s in procs1.items():
            self.total["processes"][label] = self.total["processes"].get(label, 0.0) + s - procs0.get(label, 0.0)
        for key, s in tids1.items():  # a thread started within the span counts from 0
            self.total["by_tid"][key] = self.total["by_tid"].get(key, 0.0) + s - tids0.get(key, 0.0)

    def report(self, py_spy: str | None) -> dict[str, Any]:
        """Seconds and cores (seconds / wall) per process group and per instance thread kind."""
        names: dict[tuple[int, int], str] = {}
        for pid in self.instances:
            names.update({(pid, tid): n for tid, n in thread_names(py_spy, pid).items()})
        threads: dict[str, float] = {}
        for key, s in self.total["by_tid"].items():
            kind = next((label for prefix, label in THREADS if names.get(key, "").startswith(prefix)), OTHER)
            threads[kind] = threads.get(kind, 0.0) + s
        wall = max(self.total["wall_s"], 1e-9)
        instances = max(self.total["processes"].get("instances", 0.0), 1e-9)
        return {"wall_s": wall, "processes": dict(self.total["processes"]),
                "threads": threads if names else {},
                "writer_share": threads.get("store writer", 0.0) / instances if names else None,
                "cores": {k: v / wall for k, v in self.total["processes"].items()}}


def print_report(mode: str, r: dict[str, Any]) -> None:
    procs = ", ".join(f"{k} {v:.1f} s" for k, v in r["processes"].items())
    print(f"  CPU {mode:9s} over {r['wall_s']:.1f} s: {procs}", flush=True)
    if r["threads"]:
        inst = max(r["processes"].get("instances", 0.0), 1e-9)
        print("    instances' threads: " + ", ".join(f"{k} {v:.1f} s ({v / inst:.0%})"
                                                     for k, v in sorted(r["threads"].items(), key=lambda kv: -kv[1])),
              flush=True)
