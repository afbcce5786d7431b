"""Where a profiled process spends its samples: py-spy's collapsed stacks (`--format raw`) read into the share of
samples per part of the path (inclusive: a sample counts for every part named on its stack, at most once each)
and the top frames by self samples.

    .venv/bin/python bench/pyspy_summary.py OUT.txt [--top 25]

The parts are matched on frame text (function and file), in the order listed: the first part whose pattern
appears on a stack, from its leaf up, takes the sample in the "first part" column, so that column adds up to 100 %.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

# (part, substrings of a frame "function (file:line)"), most specific first.
PARTS = (
    ("idle (epoll wait)", ("epoll_wait", "select (selectors")),
    ("access log / logging", ("logging/__init__", "line (pdserve/net/front.py")),
    ("timeline", ("telemetry/timeline",)),
    ("metrics (prometheus_client)", ("prometheus_client", "gateway/metrics")),
    ("JSON (msgspec) and usage", ("json_body", "merge_usage", "merged_usage")),
    ("upstream HTTP client", ("net/http_client",)),
    ("pairing / picking", ("gateway/pairing", "gateway/policies", "capabilities", "gateway/registry",
                           "pick (pdserve")),
    ("access guard / front / body limit", ("net/auth", "net/body", "net/front", "_header (pdserve/gateway/app.py")),
    ("uvicorn / httptools server", ("uvicorn", "httptools")),
    ("asyncio tasks / futures", ("asyncio", "uvloop")),
)


def read(path: Path) -> Counter[str]:
    stacks: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[stack] += int(count)
    return stacks


def report(path: Path, top: int = 25) -> None:
    stacks = read(path)
    total = sum(stacks.values()) or 1
    inclusive: Counter[str] = Counter()
    first: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    for stack, count in stacks.items():
        frames = stack.split(";")
        self_time[frames[-1]] += count
        for part, patterns in PARTS:
            if any(p in f for f in frames for p in patterns):
                inclusive[part] += count
        for frame in reversed(frames):
            part = next((name for name, patterns in PARTS if any(p in frame for p in patterns)), None)
            if part is not None:
                first[part] += count
                break
        else:
            first["other"] += count
    print(f"{total} samples\n| part | first part on the stack, % | anywhere on the stack, % |\n|---|---|---|")
    for part, _ in (*PARTS, ("other", ())):
        print(f"| {part} | {100 * first[part] / total:.1f} | {100 * inclusive[part] / total:.1f} |")
    print(f"\ntop {top} frames by self samples (%):")
    for frame, count in self_time.most_common(top):
        print(f"  {100 * count / total:5.1f}  {frame[:150]}")
    cumulative: Counter[str] = Counter()
    for stack, count in stacks.items():
        for function in {f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0] + ")" for f in stack.split(";")}:
            cumulative[function] += count
    print(f"\ntop {top} functions by inclusive samples (%):")
    for function, count in cumulative.most_common(top):
        print(f"  {100 * count / total:5.1f}  {function[:150]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    report(args.path, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
