"""Deadlines for waits that almost never expire, checked by one loop timer instead of one timer each.

A proxied request waits for the head of each of its two legs (deadlines of minutes) and, once it has run 50 ms,
starts watching for its client to leave. As loop timers that is three timers started and cancelled per request,
each about 1.5-2 µs under uvloop (a libuv timer set up and closed; benchmarks §12), for deadlines that are met
almost always. Here a deadline is a dict entry, and one timer checks the entries every `tick_s` while any are
pending, so a deadline is acted on up to `tick_s` late: for waits whose deadline is far longer than the tick.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable


class Sweeper:
    def __init__(self, tick_s: float) -> None:
        self.tick_s = tick_s
        self._due: dict[Hashable, tuple[float, Callable[[Hashable], None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def add(self, key: Hashable, delay: float, callback: Callable[[Hashable], None],
            loop: asyncio.AbstractEventLoop) -> None:
        """`callback(key)` once `delay` seconds have passed (up to `tick_s` later), unless `discard(key)` came first.

        `loop` is the running loop, which the caller holds: asking asyncio for it costs a system call a time on
        Python 3.11 (its check that the process did not fork), and a request adds three deadlines.
        """
        if loop is not self._loop:  # a new event loop: what was due on the last one can never be acted on there
            self._due.clear()
            self._loop, self._timer = loop, None
        self._due[key] = (loop.time() + delay, callback)
        if self._timer is None:
            self._timer = loop.call_later(self.tick_s, self._sweep)

    def discard(self, key: Hashable) -> None:
        self._due.pop(key, None)

    def _sweep(self) -> None:
        loop = self._loop
        self._timer = loop.call_later(self.tick_s, self._sweep) if self._due else None
        now = loop.time()
        for key in [key for key, (at, _) in self._due.items() if at <= now]:
            _, callback = self._due.pop(key)
            callback(key)
