"""What bench/routing.py measures its runs against: the offline bound on hit tokens, and kv_aware's own account of
its picks (`--explain`)."""

from __future__ import annotations

import re
from collections import OrderedDict

BS = 16  # the instances' block size


def offline_bound(token_lists: list[list[int]], instances: int, blocks: int, output_tokens: int) -> int:
    """Hit tokens of a router that knows every cache exactly and picks greedily (the longest cached prefix, ties to
    the least used instance), each cache an LRU of its blocks, requests one after another in the order they were
    sent; `output_tokens`: what each request adds to its instance's cache after its prompt. Greedy is no optimum:
    hash-sticky placement, which partitions the working set, can beat it."""
    from pdserve.kv_events.index import content_keys

    caches = [OrderedDict() for _ in range(instances)]
    used = [0] * instances
    hits_total = 0
    for n, tokens in enumerate(token_lists):
        keys = content_keys(tokens, BS)
        usable = (len(tokens) - 1) // BS

        def hits(cache: OrderedDict) -> int:
            count = 0
            for key in keys[:usable]:
                if key not in cache:
                    break
                count += 1
            return count

        best = max(range(instances), key=lambda i: (hits(caches[i]), -used[i]))
        hits_total += hits(caches[best]) * BS
        used[best] += len(tokens)
        cache = caches[best]
        for key in keys + [("out", n, j) for j in range((len(tokens) + output_tokens) // BS - len(keys))]:
            cache[key] = None
            cache.move_to_end(key)
            while len(cache) > blocks:
                cache.popitem(last=False)
    return hits_total


_PICK = re.compile(r"kv_aware: \d+ prompt tokens to (\S+); (.*)$")
_CANDIDATE = re.compile(r"(\S+) held (\d+) queued \d+ active \d+ cost")


def explain_picks(lines: list[str]) -> dict[str, int]:
    """kv_aware's picks, from its debug lines: the prompt tokens the index credited the chosen instance with, the
    picks where the index credited another candidate with more (load outweighed the cache) and the tokens those
    forwent, and the picks where no candidate was credited with anything."""
    out = {"picks": 0, "credited": 0, "overridden": 0, "forgone": 0, "cold": 0}
    for line in lines:
        match = _PICK.search(line)
        if match is None:
            continue
        held = {url: int(tokens) for url, tokens in _CANDIDATE.findall(match.group(2))}
        chosen, best = held.get(match.group(1), 0), max(held.values(), default=0)
        out["picks"] += 1
        out["credited"] += chosen
        if best == 0:
            out["cold"] += 1
        elif best > chosen:
            out["overridden"] += 1
            out["forgone"] += best - chosen
    return out
