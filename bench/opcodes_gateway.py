"""Bytecodes each Python function of the pdserve gateway runs per proxied request: where the interpreter's loop goes.

Under callgrind most of the gateway's instructions are the interpreter's (86 % of them, in `_PyEval_EvalFrameDefault`
and what it calls), which callgrind cannot tell apart by Python function; a sampling profiler misplaces time under
asyncio (see bench/yappi_gateway.py). This counts instead: the gateway runs under `sys.settrace` with opcode events
between two signals, and each Python function's opcodes are summed and divided by the requests wrk completed in
that window. Every opcode counts alike (a call as one), so it is a map of the Python a request runs, not a timing;
the counts at c=1 also carry a share of the gateway's background scrapes. Diagnostics only: it wraps the CLI and
changes no product code.

The stubs of bench/gateway.py (`--instances vllm` or `pdserve`), one gateway from CHECKOUT (its own code, as
bench/gateway.py runs `--base`), warmed up, then `wrk -c1` (or `--connections`) for `--seconds` while traced.

    .venv/bin/python bench/opcodes_gateway.py --checkout BEFORE --json bench/out/opcodes-before.json   # ~30 s
    .venv/bin/python bench/opcodes_gateway.py --json bench/out/opcodes-after.json \
        --compare bench/out/opcodes-before.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def traced_gateway(out: str) -> None:
    """In the gateway's process: count opcodes per function from SIGUSR1 to SIGUSR2, then write them to `out`."""
    counts: collections.Counter = collections.Counter()

    def local(frame, event, arg):  # noqa: ARG001 - sys.settrace's signature
        if event == "opcode":
            code = frame.f_code
            counts[(code.co_filename, code.co_qualname)] += 1  # no line: keys that match across versions
        return local

    def on_call(frame, event, arg):  # noqa: ARG001
        frame.f_trace_opcodes = True
        return local

    def stop(*_: object) -> None:
        sys.settrace(None)
        Path(out).write_text(json.dumps([[*key, n] for key, n in counts.items()]))

    # This script's folder holds the bench's modules (gateway.py, routing.py, ...): off the path of the gateway's.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    signal.signal(signal.SIGUSR1, lambda *_: sys.settrace(on_call))
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = ["pdserve", *sys.argv[3:]]
    runpy.run_module("pdserve", run_name="__main__")


def per_function(path: Path) -> dict[str, float]:
    data = json.loads(path.read_text())
    requests = data["requests"]
    out: dict[str, float] = collections.defaultdict(float)
    for filename, name, n in data["counts"]:
        out[f"{filename.split('/pdserve/', 1)[-1]} {name}"] += n / requests
    return out


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--traced":
        traced_gateway(sys.argv[2])
        return 0
    sys.path.insert(0, str(BENCH))
    import gateway as G  # noqa: PLC0415 - the bench's helpers, only outside the traced process
    import harness as H  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", default=str(BENCH.parent), help="whose pdserve gateway (default: this one)")
    ap.add_argument("--instances", choices=("vllm", "pdserve"), default="vllm")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--connections", type=int, default=1)
    ap.add_argument("--json", required=True, help="where to write the counts")
    ap.add_argument("--compare", help="an earlier --json: print both, largest differences first")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    cleanup = H.Cleanup()
    work = cleanup.work_dir("opcodes")
    stubs = G.start_stubs(args.instances, work, cleanup)
    raw = work / "counts.json"
    gateway = G.pdserve_gateway([sys.executable, str(Path(__file__).resolve()), "--traced", str(raw)], stubs[0].url,
                                stubs[1].url, work, cleanup, args.checkout)
    script = G.write_wrk_script(work / "wrk.lua")
    G.run_wrk(gateway.url, script, 32, 3)
    os.kill(gateway.pid, signal.SIGUSR1)
    result, _ = G.run_wrk(gateway.url, script, args.connections, args.seconds)
    os.kill(gateway.pid, signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while not raw.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    Path(args.json).write_text(json.dumps({"checkout": args.checkout, "instances": args.instances,
                                           "connections": args.connections, "requests": result["requests"],
                                           "counts": json.loads(raw.read_text())}))
    mine = per_function(Path(args.json))
    other = per_function(Path(args.compare)) if args.compare else {}
    print(f"{args.checkout}, {args.instances}-like stubs, c={args.connections}: {result['requests']} requests, "
          f"{sum(mine.values()):,.0f} bytecodes a request" +
          (f" (the compared run: {sum(other.values()):,.0f})" if other else ""))
    keys = sorted(set(mine) | set(other), key=lambda k: -abs(mine.get(k, 0) - other.get(k, 0)) if other
                  else -mine[k])
    for key in keys[:args.top]:
        print(f"{other.get(key, 0):9.1f} -> {mine.get(key, 0):9.1f}  {key}" if other else f"{mine[key]:9.1f}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
