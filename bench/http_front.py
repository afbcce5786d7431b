"""The HTTP server in front of the gateway's app, alone: pdserve's own (pdserve.net.http1) against uvicorn.

Each server runs in its own process with the same minimal ASGI app (read the body, answer a small JSON), as
`pdserve.net.listen.serve_announced` starts it for the gateway; wrk posts a small JSON body at c=1 and at c=32,
rounds alternating the order (bench/gateway.py's wrk script and body). The figure is the server process's CPU
(utime + stime, /proc) per request: the server's own cost per request, system calls included, without the
gateway's work on top.

    .venv/bin/python bench/http_front.py --rounds 3          # ~1 min; needs wrk
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import gateway as G  # noqa: E402
import harness as H  # noqa: E402


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

    async def serve() -> None:
        await serve_announced(_app, bind_socket("127.0.0.1", 0), "warning", {}, proxy_headers=False, http=http)

    uvloop.install()
    asyncio.run(serve())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--serve", choices=("pdserve", "uvicorn"), help=argparse.SUPPRESS)  # a server process
    args = ap.parse_args()
    if args.serve:
        _serve(args.serve)
        return 0
    cleanup = H.Cleanup()  # stops the servers by PID and removes the work folder, however the run ends
    work = cleanup.work_dir("http-front")
    script = G.write_wrk_script(work / "post.lua")
    servers = {http: G.spawn(http, [sys.executable, __file__, "--serve", http], work, cleanup, ready_line=True)
               for http in ("pdserve", "uvicorn")}
    cost: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for conns in (1, 32):
            for http in (("pdserve", "uvicorn") if r % 2 == 0 else ("uvicorn", "pdserve")):
                before = servers[http].cpu()
                result, _ = G.run_wrk(servers[http].url, script, conns, args.seconds)
                requests = max(result["requests"], 1)
                cost.setdefault((http, conns), []).append(1e6 * (servers[http].cpu() - before) / requests)
                print(f"round {r + 1} c={conns} {http}: {cost[http, conns][-1]:.1f} µs/request "
                      f"({requests} requests)", flush=True)
    print("| c | pdserve µs/request | uvicorn µs/request | pdserve / uvicorn (per round) |\n|---|---|---|---|")
    for conns in (1, 32):
        ours, theirs = cost["pdserve", conns], cost["uvicorn", conns]
        ratios = ", ".join(f"{a / b:.2f}" for a, b in zip(ours, theirs))
        print(f"| {conns} | {sorted(ours)[len(ours) // 2]:.1f} | {sorted(theirs)[len(theirs) // 2]:.1f} | {ratios} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
