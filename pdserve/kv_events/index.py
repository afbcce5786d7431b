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

What routing reads (the holders and the credits) are dicts of this class; what only applying events reads (each
instance's entries by engine hash, the LRU) is a core's: the C core (`pdserve/kv_events/native`) where this
machine has built it, else the Python one (`index_core.py`), which it is tested against. Applying was most of
what a KV event batch cost the gateway; the C core takes about a third of the Python one's CPU for it
(docs/benchmarks.md, section 14).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

from pdserve.kv_events import index_queries as queries
from pdserve.kv_events import native
from pdserve.kv_events.index_core import ROOT_KEY, PyCore, unset
from pdserve.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, Event

log = logging.getLogger(__name__)

STORE_PREFIX = "store:"  # a shared store's member name: the prefix, then the identity its instances announced


def content_keys(token_ids: list[int], block_size: int, limit: int | None = None, seed: int = ROOT_KEY) -> list[int]:
    """Chained keys of the whole blocks of `token_ids` (at most `limit`): key i names tokens [0, (i+1)·bs). `seed`:
    the key of the block before the first (to go on from blocks keyed before)."""
    return queries.content_keys(token_ids, 0, block_size, -1 if limit is None else limit, seed)


@dataclass(eq=False)
class _Member:
    id: int  # the core's name for it
    block_size: int = 0  # of its latest BlockStored: what its prompts are scored in
    speculative: dict[tuple[int, int], float] = field(default_factory=dict)  # (block size, key) -> expiry


@dataclass
class IndexStats:
    events: dict[str, int] = field(default_factory=dict)  # applied, by type
    orphans: int = 0  # blocks stored under a parent the index did not know (dropped)
    evicted: int = 0  # entries the LRU bound dropped
    cleared: int = 0  # instances cleared (AllBlocksCleared, restart, loss, departure)


# (tokens, start, block size, count, seed) -> the keys of `count` whole blocks from token `start` (-1: all there are)
KeysOf = Callable[[list[int], int, int, int, int], list[int]]


def _native_module() -> ModuleType | None:
    try:
        return native.load()
    except ImportError as exc:  # built for another Python, or damaged: the Python core serves
        log.warning("the KV index's C core does not load (%s): using the Python core", exc)
        return None


class PrefixIndex:
    def __init__(self, capacity: int = 1_000_000, offload_weight: float = 0.75, speculative_ttl_s: float = 10.0,
                 native_core: bool | None = None) -> None:
        """`native_core`: apply events with the C core (None: when this machine has built it)."""
        self.capacity = capacity
        self.offload_weight = offload_weight
        self.speculative_ttl_s = speculative_ttl_s
        self._stats = IndexStats()
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        self._core_ids: dict[str, int] = {}  # every member name the core has seen (a dropped member's is empty)
        # member -> the member name of the shared store it reads and writes, for those that announced one
        self._store_of: dict[str, str] = {}
        # block size -> content key -> {member: credit per block (1, or offload_weight)}
        self._holders: dict[int, dict[int, dict[str, float]]] = {}
        self._speculative: dict[int, dict[int, dict[str, float]]] = {}  # block size -> key -> {member: expiry}
        module = _native_module() if native_core is not False else None
        if native_core and module is None:
            raise RuntimeError("the KV index's C core is not built here (python -m pdserve.kv_events.native)")
        self.native = module is not None
        # What routing asks (index_queries.py): in C with the C core, with the same answers.
        self._queries = module if module is not None else queries
        self.keys_of: KeysOf = self._queries.content_keys  # how prompts are keyed for this index
        self._core = (module.Core if module is not None else PyCore)(
            self._holders, self._speculative, capacity, offload_weight, BlockStored, BlockRemoved, AllBlocksCleared)

    @property
    def stats(self) -> IndexStats:
        with self._lock:
            _, self._stats.orphans, self._stats.evicted = self._core.counters()
            return self._stats

    # -- what the listener applies ----------------------------------------------------------------------
    def apply(self, member: str, events: Sequence[Event]) -> None:
        with self._lock:
            state = self._member(member)
            store_name = self._store_of.get(member)
            store = self._member(store_name) if store_name is not None else None
            # counted per batch: an engine sends one BlockRemoved per evicted block
            stored, removed, cleared, bs, store_bs = self._core.apply(
                events, state.id, state.speculative, -1 if store is None else store.id,
                None if store is None else store.speculative)
            if bs:
                state.block_size = bs
            if store_bs:
                store.block_size = store_bs
            if cleared:  # the core forgot the entries; the credits are the index's
                self._stats.cleared += cleared
                self._drop_guesses(member, state)
            counts = self._stats.events
            for name, n in (("BlockStored", stored), ("BlockRemoved", removed), ("AllBlocksCleared", cleared)):
                if n:
                    counts[name] = counts.get(name, 0) + n

    def _member(self, name: str) -> _Member:
        state = self._members.get(name)  # not setdefault: it would build a _Member for every batch
        if state is None:
            # A member that left and came back keeps its core id: a publisher that flaps (dropped, then joined
            # again on every retry) must not grow the core by a member each time.
            core_id = self._core_ids.get(name)
            if core_id is None:
                core_id = self._core_ids[name] = self._core.add_member(name)
            state = self._members[name] = _Member(core_id)
        return state

    def join(self, member: str, block_size: int | None = None, store: str | None = None) -> None:
        """`member`'s events are flowing: score it (before its first event, by the block size it announced), and
        credit it with what the shared `store` it announced holds."""
        with self._lock:
            state = self._member(member)
            if block_size and not state.block_size:
                state.block_size = block_size
            if store is not None:
                self._store_of[member] = STORE_PREFIX + store

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
            store_name = self._store_of.pop(member, None)
            self._clear(member, state)
            if store_name is not None and store_name not in self._store_of.values():
                store = self._members.pop(store_name, None)
                if store is not None:
                    self._clear(store_name, store)

    def _clear(self, member: str, state: _Member) -> None:
        self._stats.cleared += 1
        self._core.forget_member(state.id)
        self._drop_guesses(member, state)

    def _drop_guesses(self, member: str, state: _Member) -> None:
        for bs, key in state.speculative:
            unset(self._speculative, bs, key, member)
        state.speculative.clear()

    # -- what routing asks ------------------------------------------------------------------------------
    def block_size(self, member: str) -> int:
        """The block size `member` publishes in; 0 while it has published nothing."""
        state = self._members.get(member)
        return state.block_size if state is not None else 0

    def known_run(self, keys: list[int], start: int, block_size: int) -> int:
        """How many of `keys[start:]`, from the first, some member (or store) holds or is credited with."""
        with self._lock:
            return self._queries.known_run(keys, start, self._holders.get(block_size, {}),
                                           self._speculative.get(block_size, {}))

    def guessed(self, member: str, key: int, block_size: int) -> bool:
        """Whether `member`'s credit for this block is still due: given, neither confirmed by its events nor lapsed."""
        with self._lock:
            expiry = self._speculative.get(block_size, {}).get(key, {}).get(member)
            return expiry is not None and expiry > time.monotonic()

    def overlap_blocks(self, keys: list[int], block_size: int, members: list[str]) -> dict[str, float]:
        """For each member, its credited blocks over the longest run of `keys` from the start it holds (itself,
        or in the store it reads)."""
        now = time.monotonic()
        with self._lock:
            return self._queries.overlap(keys, self._holders.get(block_size, {}), self._speculative.get(block_size, {}),
                                         members, self._store_of, now)

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
            self._queries.credit(keys, self._holders.get(block_size, {}), self._speculative.setdefault(block_size, {}),
                                 member, expiry, state.speculative, block_size)

    def sweep(self) -> None:
        """Drop expired speculative credits (the listener calls this now and then)."""
        now = time.monotonic()
        with self._lock:
            for member, state in self._members.items():
                expired = [k for k, t in state.speculative.items() if t <= now]
                for bs, key in expired:
                    del state.speculative[(bs, key)]
                    unset(self._speculative, bs, key, member)

    def held_blocks(self) -> dict[str, int]:
        with self._lock:
            return {member: self._core.held(state.id) for member, state in self._members.items()}

    def size(self) -> int:
        with self._lock:
            return self._core.counters()[0]

    def lru_items(self) -> list[tuple[str, EngineHash]]:
        """Every entry as (member, engine hash), oldest first (the C core folds a digest to 64 bits)."""
        with self._lock:
            return self._core.lru_items()
