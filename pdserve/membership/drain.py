"""Draining an instance (SIGTERM, or `POST /admin/drain` behind the admin token), in this order:

1. leave membership (the etcd record says `draining`, then its lease is revoked), so gateways stop picking it;
2. refuse new work: completions get a 503 (a gateway retries it on another instance, before the first byte),
   and `/health` answers 503 with the `pdserve-draining` header, so a gateway without a store stops at its
   next probe and a Kubernetes readiness probe takes the pod out of its Service;
3. hand off or finish the requests running here, bounded by `--drain-timeout`. The hand-off is a hook: by
   default it waits for them to finish; a decode instance may instead move them to other decode instances;
4. free every KV block held for other instances: consumers that still read get until the deadline, then
   whatever is held is released;
5. exit 0 (having said "draining" for at least LINGER_S, so that probing gateways saw it leave).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.membership.identity import DRAINING_HEADER
from pdserve.server.errors import error_body

log = logging.getLogger(__name__)
DRAIN_PATH = "/admin/drain"
_WORK = frozenset({"/v1/completions", "/v1/chat/completions"})
_POLL_S = 0.05
# A drained instance goes on answering "draining" this long before it exits, so that a gateway without a store,
# which checks /health every second, sees it leave (and stops at once) rather than fail (and retries).
LINGER_S = 2.0

# Hands off or finishes the requests running on this instance (`drain.running()`) by `deadline`
# (time.monotonic()).
HandOff = Callable[["Drain", float], Awaitable[None]]


@dataclass
class DrainState:
    """What a drain reads of its instance's KV, and what it does to it (callables, so the engine stays out)."""

    held_for_others: Callable[[], int] = lambda: 0  # KV holds other instances have not read yet
    release_held: Callable[[], int] = lambda: 0  # frees them all; returns how many
    blocks_in_use: Callable[[], int] = lambda: 0


async def wait_to_finish(drain: Drain, deadline: float) -> None:
    """The default hand-off: let the running requests finish where they are."""
    while drain.running() and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)


class Drain:
    def __init__(self, state: DrainState, timeout_s: float = 30.0,
                 leave: Callable[[], Awaitable[None]] | None = None, hand_off: HandOff = wait_to_finish) -> None:
        self.state = state
        self.timeout_s = timeout_s
        self.leave = leave  # leaves membership (the registrar); None without a store
        self.hand_off = hand_off
        self.draining = False
        self.in_flight = 0  # completions being answered (counted by DrainGuard, to their last byte)
        self.on_done: Callable[[], None] | None = None  # stops the server (exit 0)
        self._task: asyncio.Task | None = None

    def running(self) -> int:
        return self.in_flight

    def start(self) -> asyncio.Task:
        """Begin draining (idempotent: a second signal or request joins the drain under way)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self._task

    async def _run(self) -> None:
        started = time.monotonic()
        deadline = started + self.timeout_s
        log.info("drain: leaving membership, refusing new work, finishing %d running requests (at most %g s)",
                 self.running(), self.timeout_s)
        if self.leave is not None:
            await self.leave()
        self.draining = True
        await self.hand_off(self, deadline)
        left = self.running()
        while self.state.held_for_others() and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        released = self.state.release_held()
        await self._blocks_freed(deadline + 2.0)
        await asyncio.sleep(max(0.0, started + min(LINGER_S, self.timeout_s) - time.monotonic()))
        log.info("drain: done in %.2f s (%d requests cut off at the deadline, %d KV holds released unread, %d "
                 "blocks in use); exiting", time.monotonic() - started, left, released, self.state.blocks_in_use())
        if self.on_done is not None:
            self.on_done()

    async def _blocks_freed(self, deadline: float) -> None:
        """Released holds are freed by the engine's next step: wait for it (bounded)."""
        while self.state.blocks_in_use() and not self.running() and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)


class DrainGuard:
    """ASGI middleware: `POST /admin/drain` starts the drain; while it runs, new work and /health get a 503."""

    def __init__(self, app: Any, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path == DRAIN_PATH and scope["method"] == "POST":
                self.drain.start()
                await _answer(send, 202, {"draining": True, "timeout_s": self.drain.timeout_s})
                return
            if self.drain.draining and (path in _WORK or path == "/health"):
                await _answer(send, 503, error_body(503, "this instance is draining; send new work elsewhere"))
                return
            if path in _WORK:
                self.drain.in_flight += 1
                try:
                    await self.app(scope, receive, send)
                finally:
                    self.drain.in_flight -= 1
                return
        await self.app(scope, receive, send)


async def _answer(send: Any, status: int, body: dict) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (DRAINING_HEADER, b"1")]})
    await send({"type": "http.response.body", "body": msgspec.json.encode(body)})
