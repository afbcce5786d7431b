"""A small pool of threads for the CPU-heavy part of accepting a request: tokenizing, rendering chat templates,
decoding, preprocessing and hashing images.

None of that runs on the event loop, so `/health` and every other request are answered while it runs; the
tokenizers and PIL release the GIL, so the work also overlaps the engine's step. The pool is bounded: a burst of
huge prompts queues for a few threads instead of starving the engine of cores.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
MAX_WORKERS = 4


class WorkerPool:
    def __init__(self, workers: int | None = None) -> None:
        count = workers or min(MAX_WORKERS, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="pdserve-prompt")

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
