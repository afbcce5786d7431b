"""Run `pdserve gateway` under yappi (CPU clock, coroutine-aware) and write its functions' CPU time per request.

A sampling profiler misplaces time under asyncio on Python 3.11 (py-spy charges the event loop's C code to the
last Python line that ran); yappi counts each coroutine's CPU time while it runs. It slows Python calls about
threefold, so read shares and before/after differences, not absolute microseconds. Diagnostics only: it wraps
the CLI, it changes no product code. Needs yappi (`pip install -e '.[profile]'`, not needed to serve or test).

    python bench/yappi_gateway.py --after 6 --for 4 --out bench/out/yappi-after.txt -- \
        --prefill URL --decode URL --protocol pull --policy round_robin --port 0   # then load it (bench/gateway.py)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import yappi


def profile_later(start_after: float, seconds: float, out: str) -> None:
    time.sleep(start_after)
    yappi.set_clock_type("cpu")
    yappi.start()
    time.sleep(seconds)
    yappi.stop()
    stats = yappi.get_func_stats()
    stats.sort("ttot")
    with open(out, "w") as f:
        stats.print_all(out=f, columns={0: ("name", 80), 1: ("ncall", 10), 2: ("tsub", 8), 3: ("ttot", 8)})
    os.kill(os.getpid(), signal.SIGINT)  # the gateway stops as on Ctrl-C


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--after", type=float, default=6.0, help="seconds before profiling starts (start the load)")
    ap.add_argument("--for", dest="seconds", type=float, default=4.0, help="seconds profiled")
    ap.add_argument("--out", required=True)
    ap.add_argument("gateway_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    threading.Thread(target=profile_later, args=(args.after, args.seconds, args.out), daemon=True).start()
    from pdserve.cli import main as pdserve_main

    sys.argv = ["pdserve", "gateway", *[a for a in args.gateway_args if a != "--"]]
    return pdserve_main()


if __name__ == "__main__":
    sys.exit(main())
