"""The sweeper that keeps the gateway's long deadlines (pdserve/net/sweeper.py): what is due is acted on, what was
discarded is not, and a new event loop starts clean. No timing is asserted: only what happened, and in what order."""

from __future__ import annotations

import asyncio

from pdserve.net.sweeper import Sweeper


async def _until(condition, limit_s: float = 10.0) -> None:
    async with asyncio.timeout(limit_s):
        while not condition():
            await asyncio.sleep(0.01)


def test_due_entries_are_acted_on_and_discarded_ones_are_not() -> None:
    async def run() -> list[str]:
        sweeper = Sweeper(0.02)
        fired: list[str] = []
        loop = asyncio.get_running_loop()
        sweeper.add("kept", 0.01, fired.append, loop)
        sweeper.add("dropped", 0.01, fired.append, loop)
        sweeper.discard("dropped")
        sweeper.add("later", 0.2, fired.append, loop)
        await _until(lambda: "later" in fired)
        await _until(lambda: sweeper._timer is None)  # nothing pending: the sweeper's timer stops
        return fired

    assert asyncio.run(run()) == ["kept", "later"]


def test_a_new_event_loop_starts_clean() -> None:
    sweeper = Sweeper(0.02)
    fired: list[str] = []

    async def leave_pending() -> None:
        sweeper.add("on the first loop", 3600, fired.append, asyncio.get_running_loop())

    async def on_second_loop() -> None:
        sweeper.add("on the second loop", 0.01, fired.append, asyncio.get_running_loop())
        await _until(lambda: fired)

    asyncio.run(leave_pending())
    asyncio.run(on_second_loop())
    assert fired == ["on the second loop"]
