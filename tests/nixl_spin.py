"""Keep the busy-polling thread of a vLLM NixlConnector instance from taking a core the suite needs.

NIXL's Python API (1.5.1, and upstream since) creates its agent with the UCX progress thread on and a poll delay of
0, so that thread calls poll() with no timeout in a loop and burns a whole core while the instance is idle; vLLM
0.32 offers no setting to turn it off. On the 2-core machines the suite runs on, two such instances leave nothing
for the test beside them. Once an instance is healthy (and so idle), every thread of it that is not blocked in a
system call in nearly every sample is that spinner: it is moved to SCHED_IDLE, which runs it whenever a core would
otherwise idle. The transfers do not wait on it: NIXL's UCX engine progresses its workers itself when vLLM checks a
transfer's state or its notifications.

SCHED_IDLE alone does not do it where the kernel groups each session for fairness (autogroup, Debian's default): an
instance started in a session of its own whose only runnable thread is the spinner still gets a whole share. Where
the cgroup-v1 cpu controller is writable (root on such a machine), the spinner also goes into a cgroup of its own
with `cpu.idle` set, outside every autogroup; the cgroup is removed when the instance stops.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")


def _not_blocked(task: Path) -> bool:
    """True when the thread is on a CPU or runnable outside a system call, or inside poll() with a zero timeout."""
    try:
        fields = (task / "syscall").read_text().split()
    except OSError:
        return False
    if not fields:
        return False
    if fields[0] in ("running", "-1"):
        return True
    return fields[0] == "7" and len(fields) > 3 and int(fields[3], 16) == 0  # poll(fds, n, 0)


def idle_spinning_threads(pids: list[int], group: str, samples: int = 40, window_s: float = 0.8) -> list[int]:
    """Move the threads of `pids` that spin while their process is idle to SCHED_IDLE, and into the idle cgroup
    `group` where one can be made; returns their ids."""
    tasks = [task for pid in pids for task in Path(f"/proc/{pid}/task").glob("*")]
    busy = dict.fromkeys(tasks, 0)
    for _ in range(samples):
        for task in tasks:
            busy[task] += _not_blocked(task)
        time.sleep(window_s / samples)
    spinners = [int(task.name) for task, count in busy.items() if count >= 0.8 * samples]
    moved = []
    for tid in spinners:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            moved.append(tid)
        except OSError:  # exited meanwhile, or not ours to change
            pass
    if moved and (cgroup := _idle_cgroup(group)) is not None:
        for tid in moved:
            try:
                (cgroup / "tasks").write_text(str(tid))
            except OSError:
                pass
    return moved


def _idle_cgroup(name: str) -> Path | None:
    group = CPU_CGROUPS / name
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.idle").write_text("1")
    except OSError:  # not root, no cgroup-v1 cpu controller, or a kernel without cpu.idle
        remove_idle_cgroup(name)
        return None
    return group


def remove_idle_cgroup(name: str) -> None:
    """Remove the cgroup `idle_spinning_threads` made (its threads must have exited); nothing if there is none."""
    try:
        (CPU_CGROUPS / name).rmdir()
    except OSError:
        pass
