"""The KV block pool: reference counts, a least-recently-freed queue and the prefix-cache index.

Pure bookkeeping (no tensors). A block whose reference count drops to zero goes to the back of the free queue
but keeps its hash, so a later request with the same prefix can revive it; allocation takes from the front,
and only then is the stale hash forgotten.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.kv_events.block_events import BlockEvents

BlockHash = bytes

ROOT_HASH: BlockHash = b"pdserve-prefix-root"


def hash_block(parent: BlockHash, token_ids: list[int], extra: bytes = b"") -> BlockHash:
    """Chained and stable across processes, so instances can name the same prefix the same way."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    # Kept to verify a hash hit token by token: a collision must never serve another prompt's KV.
    token_ids: tuple[int, ...] = ()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.events: BlockEvents | None = None  # told what enters and leaves the prefix cache (KV events)

    # -- predicates -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    # -- actions ----------------------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > len(self.free):
            raise RuntimeError(f"asked for {num_blocks} blocks with {len(self.free)} free")
        out = []
        for _ in range(num_blocks):
            _, block = self.free.popitem(last=False)
            self._forget_hash(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache hits, reviving free ones."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each. Callers pass blocks tail first so the tail of a prompt is evicted first."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            if block.ref_count == 0:
                self.free[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: BlockHash, token_ids: tuple[int, ...],
              parent: BlockHash = ROOT_HASH) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:  # an identical block is already indexed; keep that one
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.stored(parent, block_hash, token_ids)

    def evict(self, block_ids: list[int]) -> None:
        """Remove blocks from the prefix cache (their contents are known bad)."""
        for block_id in block_ids:
            self._forget_hash(self.blocks[block_id])

    def reset_prefix_cache(self) -> None:
        events, self.events = self.events, None  # one AllBlocksCleared says it all
        for block in self.blocks:
            self._forget_hash(block)
        self.events = events
        if events is not None:
            events.cleared()

    def _forget_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = None
            block.token_ids = ()
