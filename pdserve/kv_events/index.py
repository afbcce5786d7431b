"""The gateway's global prefix index: which instance holds which prompt prefix, from their KV events.

Dual-key, as llm-d and Dynamo key theirs: a block is indexed by the gateway's own content key, a chained xxh3 of
its token ids (the same prompt gives the same keys whatever engine, flags or hash seed published it), per block
size; the engine's own hash is kept per instance only to apply its removals and to find a new block's parent.

Each (instance, engine hash) entry counts its copies per tier (an engine may hold two blocks with one hash and
remove one of them; a store may hold a block the device cache evicted): a device-cache copy credits a whole block,
any other medium (an offload tier, a shared store) `offload_weight` of one.

A shared store is a member of its own, `store:<identity>`: an instance that announced a store (its publisher
address's `store`) has its "STORAGE" blocks indexed under the store's entry, chained by the store's own hashes,
and every instance that announced the same store is credited with them at `offload_weight` (a block it holds
itself counts as it would alone, when that is more). The store's entries outlive the instance that wrote them (it
may restart, clear its cache or leave: the store keeps the blocks) and go when no instance reads the store any
more, or by the LRU bound: a store evicts and expires without events, so an entry it lost stays credited until
then (a routing miss at worst: the instance prefills what it does not find). The entries live in one LRU bounded by
`capacity`; the oldest go first, and are counted. Speculative credits (blocks the gateway just routed a prompt to,
before the instance's events say so) live apart, for `speculative_ttl_s` or until an event confirms them.
Every method takes the index's lock: a listener in a thread of its own writes while the event loop scores (in the
gateway both run in the loop, and the lock is never contended).
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from xxhash import xxh3_64_intdigest

from pdserve.kv_events.wire import MEDIUM_DEVICE, MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored, \
    EngineHash, Event, engine_key

_U64 = (1 << 64) - 1

ROOT_KEY = 1337  # the chain's seed (Dynamo seeds its block hashes with it too)
STORE_PREFIX = "store:"  # a shared store's member name: the prefix, then the identity its instances announced


def content_keys(token_ids: list[int] | array, block_size: int, limit: int | None = None, seed: int = ROOT_KEY
                 ) -> list[int]:
    """Chained keys of the whole blocks of `token_ids` (at most `limit`): key i names tokens [0, (i+1)·bs). `seed`:
    the key of the block before the first (to go on from blocks keyed before)."""
    data = memoryview(token_ids if isinstance(token_ids, array) else array("I", token_ids)).cast("B")
    step = block_size * 4
    count = len(token_ids) // block_size
    if limit is not None:
        count = min(count, limit)
    keys, key = [], seed
    for start in range(0, count * step, step):
        key = xxh3_64_intdigest(data[start:start + step], key)
        keys.append(key)
    return keys


@dataclass(slots=True, eq=False)
class _Entry:
    """One (member, engine hash) entry; the LRU holds the entries themselves (hashed by identity, not by a tuple of
    member and hash built for every block stored and removed)."""

    key: int
    block_size: int
    member: str
    ekey: EngineHash
    device: int = 0  # copies in the engine's own cache
    offload: int = 0  # copies in other tiers


@dataclass(eq=False)
class _Member:
    blocks: dict[EngineHash, _Entry] = field(default_factory=dict)
    block_size: int = 0  # of its latest BlockStored: what its prompts are scored in
    speculative: dict[tuple[int, int], float] = field(default_factory=dict)  # (block size, key) -> expiry
    # Entries per content key: an engine may hold the same tokens under two hashes (another cache salt or LoRA
    # adapter), and stays a holder of that content until the last of them goes.
    entries_of: dict[tuple[int, int], int] = field(default_factory=dict)
    store: str | None = None  # the member name of the shared store it reads and writes, if it announced one


@dataclass
class IndexStats:
    events: dict[str, int] = field(default_factory=dict)  # applied, by type
    orphans: int = 0  # blocks stored under a parent the index did not know (dropped)
    evicted: int = 0  # entries the LRU bound dropped
    cleared: int = 0  # instances cleared (AllBlocksCleared, restart, loss, departure)


class PrefixIndex:
    def __init__(self, capacity: int = 1_000_000, offload_weight: float = 0.75, speculative_ttl_s: float = 10.0
                 ) -> None:
        self.capacity = capacity
        self.offload_weight = offload_weight
        self.speculative_ttl_s = speculative_ttl_s
        self.stats = IndexStats()
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        # block size -> content key -> {member: credit per block (1, or offload_weight)}
        self._holders: dict[int, dict[int, dict[str, float]]] = {}
        self._lru: OrderedDict[_Entry, None] = OrderedDict()
        self._speculative: dict[int, dict[int, dict[str, float]]] = {}  # block size -> key -> {member: expiry}

    # -- what the listener applies ----------------------------------------------------------------------
    def apply(self, member: str, events: Iterable[Event]) -> None:
        with self._lock:
            state = self._member(member)
            store = self._member(state.store) if state.store is not None else None
            removed = stored = cleared = 0  # counted per batch: an engine sends one BlockRemoved per evicted block
            try:
                for event in events:
                    if isinstance(event, AllBlocksCleared):  # the engine's cache; a store it writes keeps its blocks
                        cleared += 1
                        self._clear(member, state)
                        continue
                    to_store = store is not None and event.medium == MEDIUM_STORAGE
                    who, where = (state.store, store) if to_store else (member, state)
                    if isinstance(event, BlockRemoved):
                        removed += 1
                        self._removed(who, where, event.block_hashes, event.medium)
                    elif isinstance(event, BlockStored):
                        stored += 1
                        self._stored(who, where, event)
            finally:
                counts = self.stats.events
                for name, n in (("BlockStored", stored), ("BlockRemoved", removed), ("AllBlocksCleared", cleared)):
                    if n:
                        counts[name] = counts.get(name, 0) + n

    def _member(self, name: str) -> _Member:
        state = self._members.get(name)  # not setdefault: it would build a _Member (three dicts) for every batch
        if state is None:
            state = self._members[name] = _Member()
        return state

    def join(self, member: str, block_size: int | None = None, store: str | None = None) -> None:
        """`member`'s events are flowing: score it (before its first event, by the block size it announced), and
        credit it with what the shared `store` it announced holds."""
        with self._lock:
            state = self._member(member)
            if block_size and not state.block_size:
                state.block_size = block_size
            if store is not None:
                state.store = STORE_PREFIX + store

    def clear(self, member: str) -> None:
        """Forget what `member` holds (its sequence restarted, events were lost, it stopped publishing)."""
        with self._lock:
            state = self._members.get(member)
            if state is not None:
                self._clear(member, state)

    def drop(self, member: str) -> None:
        """`member` left: forget it entirely, and its store once no other member reads it."""
        with self._lock:
            state = self._members.pop(member, None)
            if state is None:
                return
            self._clear(member, state)
            if state.store is not None and all(s.store != state.store for s in self._members.values()):
                store = self._members.pop(state.store, None)
                if store is not None:
                    self._clear(state.store, store)

    def _stored(self, member: str, state: _Member, event: BlockStored) -> None:
        bs = event.block_size
        device = event.medium in (None, MEDIUM_DEVICE)
        if not event.token_ids:  # a tier announcing blocks it took over: only hashes the index already knows
            for block_hash in event.block_hashes:
                entry = state.blocks.get(engine_key(block_hash))
                if entry is not None:
                    self._add_copy(member, engine_key(block_hash), entry, device)
            return
        if len(event.token_ids) != bs * len(event.block_hashes) or bs < 1:
            self.stats.orphans += len(event.block_hashes)
            return
        parent_key = ROOT_KEY
        if event.parent_block_hash is not None:
            parent = state.blocks.get(engine_key(event.parent_block_hash))
            if parent is None or parent.block_size != bs:
                self.stats.orphans += len(event.block_hashes)
                return
            parent_key = parent.key
        try:
            data = memoryview(array("I", event.token_ids)).cast("B")
        except OverflowError:  # no token id of any vocabulary
            self.stats.orphans += len(event.block_hashes)
            return
        state.block_size = bs
        step = bs * 4
        blocks, guesses = state.blocks, state.speculative
        for i, block_hash in enumerate(event.block_hashes):  # the hot loop of event handling: kept flat
            parent_key = xxh3_64_intdigest(data[i * step:(i + 1) * step], parent_key)
            ekey = block_hash & _U64 if type(block_hash) is int else bytes(block_hash)
            entry = blocks.get(ekey)
            if entry is None or entry.key != parent_key:
                if entry is not None:
                    self._forget(member, state, ekey)
                entry = blocks[ekey] = _Entry(parent_key, bs, member, ekey)
                state.entries_of[(bs, parent_key)] = state.entries_of.get((bs, parent_key), 0) + 1
            self._add_copy(member, ekey, entry, device, trim=False)
            if guesses and guesses.pop((bs, parent_key), None) is not None:
                self._unguess(member, bs, parent_key)
        self._trim()

    def _add_copy(self, member: str, ekey: EngineHash, entry: _Entry, device: bool, trim: bool = True) -> None:
        if device:
            entry.device += 1
        else:
            entry.offload += 1
        by_key = self._holders.get(entry.block_size)
        if by_key is None:
            by_key = self._holders[entry.block_size] = {}
        holders = by_key.get(entry.key)
        if holders is None:
            holders = by_key[entry.key] = {}
        holders[member] = 1.0 if entry.device else self.offload_weight
        if entry in self._lru:
            self._lru.move_to_end(entry)
        else:
            self._lru[entry] = None
        if trim:
            self._trim()

    def _trim(self) -> None:
        while len(self._lru) > self.capacity:
            oldest, _ = self._lru.popitem(last=False)
            self.stats.evicted += 1
            self._forget(oldest.member, self._members[oldest.member], oldest.ekey, in_lru=False)

    def _removed(self, member: str, state: _Member, hashes: list[EngineHash], medium: str | None) -> None:
        device = medium in (None, MEDIUM_DEVICE)
        blocks = state.blocks
        for block_hash in hashes:
            ekey = block_hash & _U64 if type(block_hash) is int else bytes(block_hash)  # engine_key, inline
            entry = blocks.get(ekey)
            if entry is None:
                continue
            if device:
                if entry.device:
                    entry.device -= 1
            elif entry.offload:
                entry.offload -= 1
            if entry.device or entry.offload:
                holders = self._holders.setdefault(entry.block_size, {}).setdefault(entry.key, {})
                holders[member] = 1.0 if entry.device else self.offload_weight
            else:
                self._forget(member, state, ekey)

    def _forget(self, member: str, state: _Member, ekey: EngineHash, in_lru: bool = True) -> None:
        entry = state.blocks.pop(ekey)
        if in_lru:
            self._lru.pop(entry, None)
        content = (entry.block_size, entry.key)
        left = state.entries_of.pop(content) - 1
        if left:
            state.entries_of[content] = left
            return  # another of its entries holds these tokens: it still holds them
        by_key = self._holders.get(entry.block_size)
        holders = by_key.get(entry.key) if by_key is not None else None
        if holders is not None:
            holders.pop(member, None)
            if not holders:
                del by_key[entry.key]

    def _clear(self, member: str, state: _Member) -> None:
        self.stats.cleared += 1
        for ekey in list(state.blocks):
            self._forget(member, state, ekey)
        for bs, key in state.speculative:
            self._unguess(member, bs, key)
        state.speculative.clear()

    def _unguess(self, member: str, block_size: int, key: int) -> None:
        by_key = self._speculative.get(block_size)
        guesses = by_key.get(key) if by_key is not None else None
        if guesses is not None:
            guesses.pop(member, None)
            if not guesses:
                del by_key[key]

    # -- what routing asks ------------------------------------------------------------------------------
    def block_size(self, member: str) -> int:
        """The block size `member` publishes in; 0 while it has published nothing."""
        state = self._members.get(member)
        return state.block_size if state is not None else 0

    def known_run(self, keys: list[int], start: int, block_size: int) -> int:
        """How many of `keys[start:]`, from the first, some member (or store) holds or is credited with."""
        with self._lock:
            holders, guesses = self._holders.get(block_size, {}), self._speculative.get(block_size, {})
            for n in range(start, len(keys)):
                if keys[n] not in holders and keys[n] not in guesses:
                    return n - start
            return len(keys) - start

    def guessed(self, member: str, key: int, block_size: int) -> bool:
        """Whether `member`'s credit for this block is still due: given, neither confirmed by its events nor lapsed."""
        with self._lock:
            expiry = self._speculative.get(block_size, {}).get(key, {}).get(member)
            return expiry is not None and expiry > time.monotonic()

    def overlap_blocks(self, keys: list[int], block_size: int, members: list[str]) -> dict[str, float]:
        """For each member, its credited blocks over the longest run of `keys` from the start it holds (itself,
        or in the store it reads)."""
        credit = dict.fromkeys(members, 0.0)
        now = time.monotonic()
        with self._lock:
            holders_by_key = self._holders.get(block_size, {})
            guesses_by_key = self._speculative.get(block_size, {})
            for member in credit:  # each member's run from the start, walked until its first miss
                state = self._members.get(member)
                store = state.store if state is not None else None
                total = 0.0
                for key in keys:
                    holders = holders_by_key.get(key)
                    weight = holders.get(member) if holders is not None else None
                    if weight is None:
                        guesses = guesses_by_key.get(key)
                        if guesses is not None and guesses.get(member, 0.0) > now:
                            weight = 1.0
                    if store is not None and holders is not None and (weight is None or weight < 1.0):
                        stored = holders.get(store)
                        if stored is not None and (weight is None or stored > weight):
                            weight = stored
                    if weight is None:
                        break
                    total += weight
                credit[member] = total
        return credit

    def credit(self, member: str, keys: list[int], block_size: int) -> None:
        """Routing chose `member` for a prompt with these keys: count the ones it must compute as held until its
        events say. A block it already holds in its device cache is not credited: the engine publishes no event
        for a block it reuses, so such a credit would never be confirmed and would outlive the block's eviction
        (its BlockRemoved drops the entry, not the credit), routing later prompts to a copy that is gone."""
        expiry = time.monotonic() + self.speculative_ttl_s
        with self._lock:
            state = self._members.get(member)
            if state is None:  # not publishing (or not reachable): scored by load alone
                return
            holders_by_key = self._holders.get(block_size, {})
            by_key = self._speculative.setdefault(block_size, {})
            for key in keys:
                holders = holders_by_key.get(key)
                if holders is not None and holders.get(member) == 1.0:
                    continue
                by_key.setdefault(key, {})[member] = expiry
                state.speculative[(block_size, key)] = expiry

    def sweep(self) -> None:
        """Drop expired speculative credits (the listener calls this now and then)."""
        now = time.monotonic()
        with self._lock:
            for member, state in self._members.items():
                expired = [k for k, t in state.speculative.items() if t <= now]
                for bs, key in expired:
                    del state.speculative[(bs, key)]
                    self._unguess(member, bs, key)

    def held_blocks(self) -> dict[str, int]:
        with self._lock:
            return {member: len(state.blocks) for member, state in self._members.items()}

    def size(self) -> int:
        return len(self._lru)
