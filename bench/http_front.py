"""The HTTP server in front of the gateway's app, alone: pdserve's own (pdserve.net.http1) against uvicorn.

Each server runs in its own process with the same minimal ASGI app (read the body, answer a small JSON), as
`pdserve.net.listen.serve_announced` starts it for the gateway; wrk posts a small JSON body at c=1 and at c=32,
rounds alternating the order. The figure is the server process's CPU (utime + stime, /proc) per request: the
server's own cost per request, system calls included, without the gateway's work on top.

    .venv/bin/python bench/http_front.py --rounds 3          # ~1 min; needs wrk
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_LUA = 'wrk.method = "POST"\nwrk.body = \'{"prompt": "hi", "max_tokens": 4}\'\n' \
       'wrk.headers["Content-Type"] = "application/json"\n'


async def _app(scope: dict, receive, send) -> None:
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"x-request-id", b"0123456789abcdef")]})
    await send({"type": "http.response.body", "body": b'{"ok": true, "text": "hello world"}'})


def _serve(http: str) -> None:
    import uvloop

    from pdserve.net.listen import bind_socket, serve_announced

    async def main() -> None:
        await serve_announced(_app, bind_socket("127.0.0.1", 0), "warning", {}, proxy_headers=False, http=http)

    uvloop.install()
    asyncio.run(main())


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--serve", choices=("pdserve", "uvicorn"), help=argparse.SUPPRESS)  # a server process
    args = ap.parse_args()
    if args.serve:
        _serve(args.serve)
        return 0
    lua = Path(tempfile.mkdtemp(prefix="pdserve-http-front-")) / "post.lua"
    lua.write_text(_LUA)
    servers = {}
    try:
        for http in ("pdserve", "uvicorn"):
            proc = subprocess.Popen([sys.executable, __file__, "--serve", http], stdout=subprocess.PIPE, text=True)
            servers[http] = (proc, json.loads(proc.stdout.readline())["port"])
        cost: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            for conns in (1, 32):
                for http in (("pdserve", "uvicorn") if r % 2 == 0 else ("uvicorn", "pdserve")):
                    proc, port = servers[http]
                    before = _cpu_s(proc.pid)
                    out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{args.seconds}s", "-s", str(lua),
                                          f"http://127.0.0.1:{port}/v1/completions"],
                                         capture_output=True, text=True, check=True).stdout
                    requests = int(out.split(" requests in ")[0].split()[-1])
                    cost.setdefault((http, conns), []).append(1e6 * (_cpu_s(proc.pid) - before) / requests)
                    print(f"round {r + 1} c={conns} {http}: {cost[http, conns][-1]:.1f} µs/request "
                          f"({requests} requests)", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(lua.parent, ignore_errors=True)
    print("| c | pdserve µs/request | uvicorn µs/request | pdserve / uvicorn (per round) |\n|---|---|---|---|")
    for conns in (1, 32):
        ours, theirs = cost["pdserve", conns], cost["uvicorn", conns]
        ratios = ", ".join(f"{a / b:.2f}" for a, b in zip(ours, theirs))
        print(f"| {conns} | {sorted(ours)[len(ours) // 2]:.1f} | {sorted(theirs)[len(theirs) // 2]:.1f} | {ratios} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
