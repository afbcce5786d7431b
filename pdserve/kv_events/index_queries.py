"""What routing asks of the prefix index, in Python: the fallback for machines without the C core, and its oracle.

The same functions, arguments and results as the C module's (`pdserve/kv_events/native/query.c`): a prompt's
chained content keys, how far a prompt's keys are known, each candidate's credited run, and the credit of the
chosen instance. The index calls them with its own dicts (block size's holders: content key -> {member: credit};
its credits: content key -> {member: expiry}), under its lock.
"""

from __future__ import annotations

from array import array

from xxhash import xxh3_64_intdigest

Holders = dict[int, dict[str, float]]  # one block size's: content key -> {member: credit per block, or expiry}


def content_keys(tokens: list[int], start: int, block_size: int, count: int, seed: int) -> list[int]:
    """The keys of `count` whole blocks from token `start` (-1: every whole block there is), each the XXH3-64 of its
    ids (as uint32) seeded with the key before it (`seed` for the first)."""
    if block_size < 1 or start < 0:
        raise ValueError("block_size must be positive and start not negative")
    end = len(tokens) if count < 0 else start + count * block_size
    data = memoryview(array("I", tokens[start:end])).cast("B")
    step = block_size * 4
    keys, key = [], seed
    for at in range(0, len(data) // step * step, step):
        key = xxh3_64_intdigest(data[at:at + step], key)
        keys.append(key)
    return keys


def known_run(keys: list[int], start: int, holders: Holders, guesses: Holders) -> int:
    """How many of `keys[start:]`, from the first, some member holds or is credited with."""
    start = max(start, 0)
    for n in range(start, len(keys)):
        if keys[n] not in holders and keys[n] not in guesses:
            return n - start
    return max(len(keys) - start, 0)


def overlap(keys: list[int], holders: Holders, guesses: Holders, members: list[str], store_of: dict[str, str],
            now: float) -> dict[str, float]:
    """For each member (and the store it reads, by `store_of`), its credited blocks over the longest run of `keys`
    from the start that it holds: its own copy's credit, 1 for a credit not expired, the store's copy where worth
    more."""
    out = {}
    for member in members:
        store = store_of.get(member)
        total = 0.0
        for key in keys:
            by_member = holders.get(key)
            weight = by_member.get(member) if by_member is not None else None
            if weight is None:
                credited = guesses.get(key)
                if credited is not None and credited.get(member, 0.0) > now:
                    weight = 1.0
            if store is not None and by_member is not None and (weight is None or weight < 1.0):
                stored = by_member.get(store)
                if stored is not None and (weight is None or stored > weight):
                    weight = stored
            if weight is None:
                break
            total += weight
        out[member] = total
    return out


def credit(keys: list[int], holders: Holders, guesses: Holders, member: str, expiry: float,
           member_guesses: dict[tuple[int, int], float], block_size: int) -> None:
    """Credit `member` until `expiry` with each block of `keys` it does not hold in its device cache (its engine
    publishes nothing for a block it reuses, so such a credit would never be confirmed), in the block size's
    credits and in the member's own record (keyed (block size, key))."""
    for key in keys:
        by_member = holders.get(key)
        if by_member is not None and by_member.get(member) == 1.0:
            continue
        guesses.setdefault(key, {})[member] = expiry
        member_guesses[(block_size, key)] = expiry
