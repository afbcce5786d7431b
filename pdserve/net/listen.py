"""Listening sockets and serving an ASGI app (uvicorn, or pdserve's own HTTP/1.1 server), for both kinds of
process (instance and gateway).
Nothing here imports the engine or torch: the gateway is a light process and must stay one."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
from collections.abc import Callable

import uvicorn

from pdserve.net.http1 import Http1Server

# Longer than any client pool's idle timeout, so the server never closes a connection a gateway is reusing.
KEEP_ALIVE_S = 75


class StartupError(Exception):
    """A process cannot start (a port in use, a bad flag value): reported as one line, exit status 2."""


def bind_socket(host: str, port: int) -> socket.socket:
    """Bound and listening; raises StartupError naming the address when it is taken or not ours to use."""
    try:
        return _bind(host, port)
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _bind(host: str, port: int) -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only when the listening socket
    # says so, and without it every small JSON answer waits ~40 ms on Nagle and delayed ACKs (measured).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def freeze_startup_objects() -> None:
    """Move everything built at startup out of the garbage collector's sight: full collections otherwise
    walk those objects every time and stall requests (measured: ~100 ms p99 stalls on the gateway)."""
    gc.collect()
    gc.freeze()


def announce_ready(**fields: object) -> None:
    """One JSON line on stdout that tests and scripts wait for (it carries the real port when --port 0)."""
    print(json.dumps({"event": "ready", "pid": os.getpid(), **fields}), flush=True)


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGTERM may start a drain instead of stopping at once."""

    on_sigterm: Callable[[], None] | None = None

    def handle_exit(self, sig: int, frame: object) -> None:
        if sig == signal.SIGTERM and self.on_sigterm is not None and not self.should_exit:
            self.on_sigterm()
            return
        super().handle_exit(sig, frame)


async def serve_announced(app: object, sock: socket.socket, log_level: str, fields: dict[str, object],
                          admin_sock: socket.socket | None = None,
                          drain: Callable[[Callable[[], None]], Callable[[], None]] | None = None,
                          proxy_headers: bool = True, http: str = "uvicorn") -> None:
    """Serve `app` on `sock` and print the ready line once it accepts connections: with uvicorn (httptools; no
    WebSocket protocol, as no route speaks one), or with `http="pdserve"` on pdserve's own HTTP/1.1 server
    (pdserve.net.http1: the gateway's default, for its per-request cost).

    `proxy_headers=False` leaves out uvicorn's X-Forwarded-For middleware, a layer every request crosses: for an app
    that reads the client's address only to log it (pdserve.net.auth.peer names the forwarded-for client itself).
    pdserve's server has no such layer.

    With `admin_sock`, the same app is served there too (it tells the two apart by the local port), and the
    ready line carries `admin_port`. With `drain`, SIGTERM calls what `drain(stop)` returned instead of stopping
    the server; the drain calls `stop` when it is done.
    """
    sockets = [sock]
    if admin_sock is not None:
        sockets.append(admin_sock)
        fields = {**fields, "admin_port": admin_sock.getsockname()[1]}
    server: _Server | Http1Server
    if http == "pdserve":
        server = Http1Server(app, keep_alive_s=KEEP_ALIVE_S)
        stop: Callable[[], None] = server.stop
    else:
        server = _Server(uvicorn.Config(app, log_level=log_level.lower(), access_log=False, lifespan="off",
                                        timeout_keep_alive=KEEP_ALIVE_S, http="httptools", ws="none",
                                        proxy_headers=proxy_headers))
        stop = lambda: setattr(server, "should_exit", True)  # noqa: E731 - uvicorn's own way to stop
    if drain is not None:
        loop = asyncio.get_running_loop()
        on_term = drain(stop)
        server.on_sigterm = lambda: loop.call_soon_threadsafe(on_term)

    async def ready_when_started() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.01)
        if server.started:
            announce_ready(host=sock.getsockname()[0], port=sock.getsockname()[1], **fields)

    announcer = asyncio.create_task(ready_when_started())
    try:
        await server.serve(sockets=sockets)
    finally:
        announcer.cancel()
