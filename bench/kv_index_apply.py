"""How fast the prefix index applies KV events, with its C core and with its Python core, side by side.

Batches shaped as the routing bench's instances send them (section 14: a `BlockStored` of 11 blocks of 16 tokens,
and as many removals as that evicts from a 96-block cache), in both of vLLM's shapes of removal: one `BlockRemoved`
per evicted block, as vLLM sends them, and one event listing them all, as pdserve's publisher does. Each batch is
encoded once, then decoded and applied as the gateway's listener does (`decode_batch`, `PrefixIndex.apply`), over
four members, hot in a loop; the two cores alternate in every round. What this measures is the index's capacity
for events; what a batch costs among a live gateway's other work is `bench/kv_listener_cpu.py`'s.

    .venv/bin/python bench/kv_index_apply.py --rounds 5
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]
from pdserve.kv_events.index import PrefixIndex  # noqa: E402
from pdserve.kv_events.wire import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch  # noqa: E402

BS, BLOCKS, CACHE, MEMBERS = 16, 11, 96, 4


def payloads(count: int, one_removal_per_block: bool, seed: int = 1) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    out, next_hash, held = [], [1] * MEMBERS, [[] for _ in range(MEMBERS)]
    for _ in range(count):
        m = rng.randrange(MEMBERS)
        hashes = list(range(next_hash[m], next_hash[m] + BLOCKS))
        next_hash[m] += BLOCKS
        events: list = [BlockStored(block_hashes=hashes, parent_block_hash=None, block_size=BS, lora_id=None,
                                    token_ids=[rng.randrange(30000) for _ in range(BLOCKS * BS)], medium="GPU",
                                    lora_name=None)]
        held[m] += hashes
        evicted = held[m][:-CACHE]
        held[m] = held[m][-CACHE:]
        if evicted:
            events += [BlockRemoved(block_hashes=[h], medium="GPU") for h in evicted] if one_removal_per_block \
                else [BlockRemoved(block_hashes=evicted, medium="GPU")]
        out.append((f"m{m}", encode_batch(KVEventBatch(time.time(), events))))
    return out


def run(batches: list[tuple[str, bytes]], native_core: bool) -> float:
    """Seconds to decode and apply every batch into a fresh index."""
    index = PrefixIndex(native_core=native_core)
    start = time.perf_counter()
    for member, payload in batches:
        index.apply(member, decode_batch(payload).events)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", type=int, default=4000)
    args = p.parse_args()
    if not PrefixIndex().native:
        sys.exit("the C core is not built here: python -m pdserve.kv_events.native")
    blocks = BLOCKS * 2  # stored and removed, per batch once the caches are full
    for shape, per_block in (("one BlockRemoved per block (vLLM)", True), ("removals in one event (pdserve)", False)):
        batches = payloads(args.batches, per_block)
        times: dict[str, list[float]] = {"C": [], "Python": []}
        for rnd in range(args.rounds):
            for core in ("C", "Python") if rnd % 2 == 0 else ("Python", "C"):
                times[core].append(run(batches, core == "C") / len(batches) * 1e6)
        c, py = (sorted(times[k])[len(times[k]) // 2] for k in ("C", "Python"))
        print(f"{shape}: C {c:.1f} us per batch ({c / blocks * 1000:.0f} ns per block), Python {py:.1f} "
              f"({py / blocks * 1000:.0f} ns per block): C / Python {c / py:.2f}; per round C "
              f"{', '.join(f'{v:.1f}' for v in times['C'])}, Python {', '.join(f'{v:.1f}' for v in times['Python'])}")


if __name__ == "__main__":
    main()
