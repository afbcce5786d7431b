"""User-space instructions per proxied request of the pdserve gateway, under callgrind: a cost account that the
box's neighbours do not move (CPU time per request moved by up to ±30 % between rounds on the shared 2-core box).

The stubs of bench/gateway.py (`--instances vllm` or `pdserve`), one gateway started under
`valgrind --tool=callgrind` from CHECKOUT (its own code: run from its directory, as bench/gateway.py runs
`--base`), warmed up, then counters zeroed, `wrk -c32` (or `--connections`) for `--seconds`, and one dump. Prints the instructions per
request and those of a few parts (inclusive counts of their C entry points, from callgrind_annotate). Under
callgrind a request takes ~50× longer, so every request outlives the 50 ms after which its disconnect watch starts
(the "loop timers" part), which at real speed almost none does; kernel time is not counted. Needs valgrind.

    .venv/bin/python bench/callgrind_gateway.py --checkout BEFORE --instances pdserve   # ~1 min each
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import gateway as G  # noqa: E402
import harness as H  # noqa: E402

# part -> patterns of the C functions whose inclusive count is that part's
PARTS = {
    "garbage collector": [r"gcmodule\.c:gc_collect_main "],
    "msgspec decode": [r":msgspec_json_decode ", r":JSONDecoder_decode "],
    "msgspec encode": [r":json_encode "],
    "httptools parsing and its callbacks (server and client)": [r"HttpParser_13feed_data "],
    "uvicorn's header checks (re)": [r"sre\.c:_sre_SRE_Pattern_search "],
    "loop timers run": [r"TimerHandle__run "],
}


def parts_of(dump: Path) -> dict[str, int]:
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(dump)],
                         capture_output=True, text=True, check=True).stdout
    found: dict[str, int] = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+) \([\s\d.]+%\)\s+(.*)", line)
        if m:
            count, name = int(m.group(1).replace(",", "")), m.group(2) + " "
            for part, patterns in PARTS.items():
                if any(re.search(p, name) for p in patterns):
                    found[part] = max(found.get(part, 0), count)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", default=str(BENCH.parent), help="whose pdserve gateway (default: this one)")
    ap.add_argument("--instances", choices=("vllm", "pdserve"), default="pdserve")
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--connections", type=int, default=32, help="wrk's -c: 32, or 1 for one request at a time")
    args = ap.parse_args()
    cleanup = H.Cleanup()
    work = cleanup.work_dir("callgrind")  # removed at exit, with the callgrind dumps in it
    stubs = G.start_stubs(args.instances, work, cleanup)
    out = work / "callgrind.out"
    gateway = G.pdserve_gateway(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m",
                                 "pdserve"], stubs[0].url, stubs[1].url, work, cleanup, args.checkout)
    script = G.write_wrk_script(work / "wrk.lua")
    G.run_wrk(gateway.url, script, 32, 3)
    subprocess.run(["callgrind_control", "--zero", str(gateway.pid)], check=True, capture_output=True)
    result, _ = G.run_wrk(gateway.url, script, args.connections, args.seconds)
    subprocess.run(["callgrind_control", "--dump", str(gateway.pid)], check=True, capture_output=True)
    dump = min(work.glob("callgrind.out.*"))
    n = max(result["requests"], 1)
    total = int(next(line for line in dump.read_text().splitlines() if line.startswith("totals:")).split()[1])
    print(f"{args.checkout} in front of {args.instances}-like stubs, c={args.connections}: {result['requests']} "
          f"requests, "
          f"{result['errors'] + result['non2xx']} errors\n| part | instructions per request | % |\n|---|---|---|")
    print(f"| total | {total / n:,.0f} | 100 |")
    for part, count in parts_of(dump).items():
        print(f"| {part} | {count / n:,.0f} | {100 * count / total:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
