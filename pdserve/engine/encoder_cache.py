"""Which encoder outputs the model runner holds, and for whom: bookkeeping only (the runner owns the tensors).

An output is computed (or loaded) once per mm_hash and shared by every request whose prompt holds that item.
Entries count against a budget of embeddings; when one is needed, entries no live request references are
evicted, least recently used first. The runner is told each step which entries to drop.
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve.ids import ReqId


class EncoderCacheManager:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.sizes: OrderedDict[str, int] = OrderedDict()  # mm_hash -> embeddings, least recently used first
        self.refs: dict[str, set[ReqId]] = {}
        self.used = 0
        self._freed: list[str] = []
        self.hits = 0
        self.misses = 0

    # -- predicates -----------------------------------------------------------------------------------------
    def holds(self, mm_hash: str) -> bool:
        return mm_hash in self.sizes

    @property
    def num_held(self) -> int:
        """Entries some live request still needs."""
        return sum(1 for refs in self.refs.values() if refs)

    @property
    def num_entries(self) -> int:
        return len(self.sizes)

    # -- actions --------------------------------------------------------------------------------------------
    def use(self, mm_hash: str, size: int, request_id: ReqId) -> bool:
        """Reference an entry for a request; True if it must first be produced (encoded or loaded)."""
        self.refs.setdefault(mm_hash, set()).add(request_id)
        if mm_hash in self.sizes:
            self.sizes.move_to_end(mm_hash)
            self.hits += 1
            return False
        self._make_room(size)
        self.sizes[mm_hash] = size
        self.used += size
        self.misses += 1
        return True

    def forget(self, mm_hash: str) -> None:
        """Drop an entry that could not be produced (its load failed); it will be made again when needed."""
        size = self.sizes.pop(mm_hash, None)
        if size is not None:
            self.used -= size
            self._freed.append(mm_hash)

    def release(self, request_id: ReqId) -> None:
        for mm_hash, refs in list(self.refs.items()):
            refs.discard(request_id)
            if not refs:
                del self.refs[mm_hash]

    def take_freed(self) -> list[str]:
        out, self._freed = self._freed, []
        return out

    def _make_room(self, size: int) -> None:
        for mm_hash in list(self.sizes):
            if self.used + size <= self.budget:
                return
            if not self.refs.get(mm_hash):
                self.used -= self.sizes.pop(mm_hash)
                self._freed.append(mm_hash)
