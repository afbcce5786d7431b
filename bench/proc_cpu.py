"""CPU time from /proc (a public seam: nothing in the product is patched).

Threads and processes by their schedstat (run time in nanoseconds): the 10 ms ticks of /proc/<pid>/stat are too
coarse for stretches of a few hundred milliseconds (a migration's move, a gateway's idle second). The box as a
whole by /proc/stat's busy ticks.
"""

from __future__ import annotations

import os
from pathlib import Path


def thread_seconds(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of `pid` (threads that already ended are not counted); {} once it is gone."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            out[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
        except (OSError, IndexError, ValueError):
            continue
    return out


def thread_seconds_by_name(pid: int) -> dict[str, float]:
    """CPU seconds of a process's live threads, summed by thread name (`comm`: an event loop's "python", ZMQ's
    "ZMQbg/IO/0", ...)."""
    out: dict[str, float] = {}
    for tid, seconds in thread_seconds(pid).items():
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + seconds
    return out


def sched_seconds(pid: int) -> float:
    """CPU seconds of `pid`'s live threads; 0 if it is gone."""
    return sum(thread_seconds(pid).values())


def box_busy_s() -> float:
    """CPU seconds the whole box has spent busy (user, nice, system, irq, softirq over every core) since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[i] for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")
