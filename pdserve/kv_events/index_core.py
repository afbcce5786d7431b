"""The prefix index's event application in Python: the fallback for machines without the C core, and its oracle.

It has the C core's interface (`pdserve/kv_events/native/core.c`) and leaves the same dicts behind: the index
hands both its holders (block size -> content key -> {member: credit}) and its speculative credits (block size ->
content key -> {member: expiry}); a core owns only what event application reads alone: each member's entries by
engine hash, how many of them hold one content key, and the LRU over all entries. Members are small integers
(`add_member`), as the C core keys them.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from xxhash import xxh3_64_intdigest

from pdserve.kv_events.wire import MEDIUM_DEVICE, MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored, \
    EngineHash, Event, engine_key

ROOT_KEY = 1337  # the chain's seed (Dynamo seeds its block hashes with it too)
_U64 = (1 << 64) - 1

Holders = dict[int, dict[int, dict[str, float]]]


@dataclass(slots=True, eq=False)
class _Entry:
    """One (member, engine hash) entry; the LRU holds the entries themselves (hashed by identity, not by a tuple of
    member and hash built for every block stored and removed)."""

    key: int
    block_size: int
    member: int
    ekey: EngineHash
    device: int = 0  # copies in the engine's own cache
    offload: int = 0  # copies in other tiers


class PyCore:
    def __init__(self, holders: Holders, speculative: Holders, capacity: int, offload_weight: float,
                 stored_type: type = BlockStored, removed_type: type = BlockRemoved,
                 cleared_type: type = AllBlocksCleared) -> None:
        self._holders, self._speculative = holders, speculative
        self._stored_type, self._removed_type, self._cleared_type = stored_type, removed_type, cleared_type
        self.capacity, self.offload_weight = capacity, offload_weight
        self._names: list[str] = []
        self._blocks: list[dict[EngineHash, _Entry]] = []
        # Entries per content key: an engine may hold the same tokens under two hashes (another cache salt or LoRA
        # adapter), and stays a holder of that content until the last of them goes.
        self._entries_of: list[dict[tuple[int, int], int]] = []
        self._lru: OrderedDict[_Entry, None] = OrderedDict()
        self.orphans = self.evicted = 0

    def add_member(self, name: str) -> int:
        self._names.append(name)
        self._blocks.append({})
        self._entries_of.append({})
        return len(self._names) - 1

    def apply(self, events: Sequence[Event], member: int, guesses: dict, store: int, store_guesses: dict | None
              ) -> tuple[int, int, int, int, int]:
        """(BlockStored, BlockRemoved, AllBlocksCleared events, the block size `member` and `store` stored in or 0).
        `guesses`: the member's credits by (block size, key), which its stored blocks confirm; `store` (-1: none)
        takes the events of medium STORAGE."""
        n_stored = n_removed = n_cleared = bs_mine = bs_store = 0
        for event in events:
            if isinstance(event, self._cleared_type):  # the engine's cache; a store it writes keeps its blocks
                n_cleared += 1
                self.forget_member(member)
                continue
            to_store = store >= 0 and event.medium == MEDIUM_STORAGE
            who = store if to_store else member
            if isinstance(event, self._removed_type):
                n_removed += 1
                self._removed(who, event.block_hashes, event.medium)
            elif isinstance(event, self._stored_type):
                n_stored += 1
                bs = self._stored(who, event, store_guesses if to_store else guesses)
                if bs and to_store:
                    bs_store = bs
                elif bs:
                    bs_mine = bs
        return n_stored, n_removed, n_cleared, bs_mine, bs_store

    def forget_member(self, member: int) -> None:
        for ekey in list(self._blocks[member]):
            self._forget(member, ekey)

    def held(self, member: int) -> int:
        return len(self._blocks[member])

    def lru_items(self) -> list[tuple[str, EngineHash]]:
        return [(self._names[entry.member], entry.ekey) for entry in self._lru]

    def counters(self) -> tuple[int, int, int]:
        return len(self._lru), self.orphans, self.evicted

    def _stored(self, member: int, event: BlockStored, guesses: dict | None) -> int:
        bs = event.block_size
        device = event.medium in (None, MEDIUM_DEVICE)
        blocks = self._blocks[member]
        if not event.token_ids:  # a tier announcing blocks it took over: only hashes the index already knows
            for block_hash in event.block_hashes:
                entry = blocks.get(engine_key(block_hash))
                if entry is not None:
                    self._add_copy(entry, device)
            return 0
        if len(event.token_ids) != bs * len(event.block_hashes) or bs < 1:
            self.orphans += len(event.block_hashes)
            return 0
        parent_key = ROOT_KEY
        if event.parent_block_hash is not None:
            parent = blocks.get(engine_key(event.parent_block_hash))
            if parent is None or parent.block_size != bs:
                self.orphans += len(event.block_hashes)
                return 0
            parent_key = parent.key
        try:
            data = memoryview(array("I", event.token_ids)).cast("B")
        except OverflowError:  # no token id of any vocabulary
            self.orphans += len(event.block_hashes)
            return 0
        step = bs * 4
        entries_of = self._entries_of[member]
        for i, block_hash in enumerate(event.block_hashes):  # the hot loop of event handling: kept flat
            parent_key = xxh3_64_intdigest(data[i * step:(i + 1) * step], parent_key)
            ekey = block_hash & _U64 if type(block_hash) is int else bytes(block_hash)
            entry = blocks.get(ekey)
            if entry is None or entry.key != parent_key:
                if entry is not None:
                    self._forget(member, ekey)
                entry = blocks[ekey] = _Entry(parent_key, bs, member, ekey)
                entries_of[(bs, parent_key)] = entries_of.get((bs, parent_key), 0) + 1
            self._add_copy(entry, device, trim=False)
            if guesses and guesses.pop((bs, parent_key), None) is not None:
                unset(self._speculative, bs, parent_key, self._names[member])
        self._trim()
        return bs

    def _add_copy(self, entry: _Entry, device: bool, trim: bool = True) -> None:
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
        holders[self._names[entry.member]] = 1.0 if entry.device else self.offload_weight
        if entry in self._lru:
            self._lru.move_to_end(entry)
        else:
            self._lru[entry] = None
        if trim:
            self._trim()

    def _trim(self) -> None:
        while len(self._lru) > self.capacity:
            oldest, _ = self._lru.popitem(last=False)
            self.evicted += 1
            self._forget(oldest.member, oldest.ekey, in_lru=False)

    def _removed(self, member: int, hashes: list[EngineHash], medium: str | None) -> None:
        device = medium in (None, MEDIUM_DEVICE)
        blocks = self._blocks[member]
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
                holders[self._names[member]] = 1.0 if entry.device else self.offload_weight
            else:
                self._forget(member, ekey)

    def _forget(self, member: int, ekey: EngineHash, in_lru: bool = True) -> None:
        entry = self._blocks[member].pop(ekey)
        if in_lru:
            self._lru.pop(entry, None)
        content = (entry.block_size, entry.key)
        entries_of = self._entries_of[member]
        left = entries_of.pop(content) - 1
        if left:
            entries_of[content] = left
            return  # another of its entries holds these tokens: it still holds them
        unset(self._holders, entry.block_size, entry.key, self._names[member])


def unset(table: Holders, block_size: int, key: int, name: str) -> None:
    """Remove `name` from table[block_size][key] (the holders, or the credits), and the key once nobody is left."""
    by_key = table.get(block_size)
    inner = by_key.get(key) if by_key is not None else None
    if inner is not None:
        inner.pop(name, None)
        if not inner:
            del by_key[key]
