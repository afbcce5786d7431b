"""The gateway's KV-event listener: CPU per batch read in a thread of its own, or in the event loop at each pick.

Four pdserve publishers (a child process) send batches shaped like the routing bench's (section 14: per request
~1.85 batches, ~20 one-block `BlockRemoved` and ~20 blocks stored, so a batch here is one `BlockStored` of 11
blocks and 11 removals) at the bench's pace (~50 batches a second in all). Beside them, this process runs an
event loop doing a little Python work every few milliseconds (the gateway's request handling) and a pick every
40 ms (25 requests a second) that calls the listener's `catch_up`, as `kv_aware` does. Modes:

* `none`: the loop and its picks, nothing subscribed (the baseline subtracted from the others);
* `thread`: `Listener.start()`, the listener's own thread woken by each batch (main before the change);
* `loop`: `Listener.attach(loop)`, live batches read at the picks and on the listener's timer.

Each mode runs with the index's C core where this machine has built it; `-python` after a mode runs it with the
Python core (`PrefixIndex(native_core=False)`), so the two cores are compared in the same rounds.

CPU is the process's (all threads, /proc schedstat), over the same seconds of publishing, less the `none` run's of
the same round; modes interleave in each round. On a shared 2-vCPU box that difference moves by more than the
listener costs, so the picks' own CPU is reported beside it: the thread CPU time spent in `catch_up` (reading,
decoding and applying what came since the last pick) per batch, and ZMQ's I/O thread's (receiving them), both
measured in this process without the baseline's subtraction. Measured through the listener's public calls;
nothing in it is patched.

    .venv/bin/python bench/kv_listener_cpu.py --rounds 3 --seconds 15 --modes loop,loop-python
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]
from proc_cpu import sched_seconds, thread_seconds_by_name  # noqa: E402

from pdserve.kv_events.config import KVEventsConfig  # noqa: E402
from pdserve.kv_events.index import PrefixIndex  # noqa: E402
from pdserve.kv_events.listener import Listener  # noqa: E402
from pdserve.kv_events.publisher import KVEventPublisher  # noqa: E402
from pdserve.kv_events.wire import BlockRemoved, BlockStored  # noqa: E402

BS = 16
PUBLISHERS = 4
BLOCKS_PER_BATCH = 11
CACHE_BLOCKS = 96


def publish(folder: str, period_s: float, seconds: float, ready: mp.Queue, go: mp.Event) -> None:
    pubs = [KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{folder}/p{i}.pub",
                                            replay_endpoint=f"ipc://{folder}/p{i}.replay", topic=f"kv@{i}"),
                             block_size=BS) for i in range(PUBLISHERS)]
    ready.put([p.address() for p in pubs])
    go.wait()
    rng = random.Random(1)
    next_hash, held = [1] * PUBLISHERS, [[] for _ in pubs]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        i = rng.randrange(PUBLISHERS)
        hashes = list(range(next_hash[i], next_hash[i] + BLOCKS_PER_BATCH))
        next_hash[i] += BLOCKS_PER_BATCH
        pubs[i].record(BlockStored(block_hashes=hashes, parent_block_hash=None, block_size=BS, lora_id=None,
                                   token_ids=[rng.randrange(30000) for _ in range(len(hashes) * BS)],
                                   medium="GPU", lora_name=None))
        held[i] += hashes
        while len(held[i]) > CACHE_BLOCKS:  # one event per evicted block, as an engine sends them
            pubs[i].record(BlockRemoved(block_hashes=[held[i].pop(0)], medium="GPU"))
        pubs[i].end_step()
        time.sleep(rng.expovariate(1 / period_s))
    time.sleep(0.5)
    for p in pubs:
        p.close()


async def gateway_like(mode: str, addresses: list, seconds: float, go: mp.Event) -> tuple[int, float, float, float]:
    """(batches applied, CPU seconds of the process, of the picks' `catch_up` and of ZMQ's I/O threads) while the
    publishers send."""
    listener = Listener(PrefixIndex(native_core=False if mode.endswith("-python") else None))
    if mode.startswith("thread"):
        listener.start()
    else:
        listener.attach(asyncio.get_running_loop())
    if mode != "none":
        listener.set_members({f"m{i}": a for i, a in enumerate(addresses)})
    await asyncio.sleep(1.5)
    stop = asyncio.Event()

    async def requests() -> None:  # a little Python work every few milliseconds
        while not stop.is_set():
            sum(j * j for j in range(1500))
            await asyncio.sleep(0.004)

    picking = [0.0]

    async def picks() -> None:
        while not stop.is_set():
            start = time.thread_time()
            listener.catch_up()
            picking[0] += time.thread_time() - start
            await asyncio.sleep(0.04)

    tasks = [asyncio.create_task(requests()), asyncio.create_task(picks())]
    batches0, cpu0 = sum(c.batches for _, c in listener.snapshot().values()), sched_seconds(os.getpid())
    io0, picking[0] = zmq_io_seconds(), 0.0
    go.set()
    await asyncio.sleep(seconds + 0.5)
    batches, cpu = sum(c.batches for _, c in listener.snapshot().values()) - batches0, sched_seconds(os.getpid()) - cpu0
    io, picked = zmq_io_seconds() - io0, picking[0]
    stop.set()
    await asyncio.gather(*tasks)
    listener.stop()
    return batches, cpu, picked, io


def zmq_io_seconds() -> float:
    """CPU seconds of this process's ZMQ I/O threads (named ZMQbg/IO/n)."""
    return sum(seconds for name, seconds in thread_seconds_by_name(os.getpid()).items() if name.startswith("ZMQbg/IO"))


def one(mode: str, seconds: float, period_s: float) -> tuple[int, float, float, float]:
    import uvloop

    with tempfile.TemporaryDirectory() as folder:
        ready, go = mp.Queue(), mp.Event()
        child = mp.Process(target=publish, args=(folder, period_s, seconds, ready, go))
        child.start()
        try:
            return uvloop.run(gateway_like(mode, ready.get(timeout=30), seconds, go))
        finally:
            child.join(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--period-ms", type=float, default=20.0, help="mean time between two batches (of any publisher)")
    p.add_argument("--modes", default="thread,loop", help="comma-separated: thread, loop, thread-python, loop-python")
    args = p.parse_args()
    modes = args.modes.split(",")
    per_batch: dict[str, list[float]] = {mode: [] for mode in modes}
    picks: dict[str, list[float]] = {mode: [] for mode in modes}
    for rnd in range(args.rounds):
        _, base_cpu, _, _ = one("none", args.seconds, args.period_ms / 1000)
        for mode in modes if rnd % 2 == 0 else modes[::-1]:
            batches, cpu, picked, io = one(mode, args.seconds, args.period_ms / 1000)
            n = max(batches, 1)
            per_batch[mode].append((cpu - base_cpu) / n * 1e6)
            picks[mode].append((picked + io) / n * 1e6)
            print(f"round {rnd} {mode:13s} {batches} batches, CPU {cpu:.3f} s (baseline {base_cpu:.3f} s): "
                  f"{per_batch[mode][-1]:.0f} us per batch; picks {picked / n * 1e6:.0f} + ZMQ I/O {io / n * 1e6:.0f} "
                  f"us per batch", flush=True)
    for mode in modes:
        print(f"{mode}: median {median(per_batch[mode]):.0f} us per batch "
              f"({', '.join(f'{v:.0f}' for v in per_batch[mode])}); picks + ZMQ I/O median {median(picks[mode]):.0f} "
              f"({', '.join(f'{v:.0f}' for v in picks[mode])})")


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


if __name__ == "__main__":
    main()
