"""CPU time from /proc at nanosecond resolution (a public seam: nothing in the product is patched).

The 10 ms ticks of /proc/<pid>/stat are too coarse for stretches of a few hundred milliseconds (a migration's
move); each thread's schedstat counts its run time in nanoseconds.
"""

from __future__ import annotations

import os
from pathlib import Path


def process_cpu_s(pid: int) -> float:
    """CPU seconds of `pid`'s live threads (threads that already ended are not counted); 0 if it is gone."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def box_busy_s() -> float:
    """CPU seconds the whole box has spent busy (user, nice, system, irq, softirq over every core) since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[i] for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")
