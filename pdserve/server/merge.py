"""Several engine output streams as one (the samples and prompts of one request), in arrival order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pdserve.engine.output_processor import RequestOutput


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as items arrive; closing the merge closes every stream (aborting)."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
