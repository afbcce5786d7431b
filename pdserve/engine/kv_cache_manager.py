"""Per-request block tables on top of the block pool: prefix-cache hits, slot allocation, freeing."""

from __future__ import annotations

from pdserve.engine.block_pool import ROOT_HASH, BlockHash, BlockPool, KVBlock, hash_block
from pdserve.engine.request import Request
from pdserve.ids import ReqId
from pdserve.utils import cdiv


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[ReqId, list[KVBlock]] = {}
        self.req_hashes: dict[ReqId, list[BlockHash]] = {}
        self.num_cached_blocks: dict[ReqId, int] = {}
        self.prefix_queries = 0  # tokens looked up (vLLM counts tokens, not requests)
        self.prefix_hits = 0

    # -- queries ----------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def has_blocks(self, request_id: ReqId) -> bool:
        return bool(self.req_blocks.get(request_id))

    def block_ids(self, request_id: ReqId) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Chained hashes of the request's full blocks, extended as its tokens grow."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        num_full = request.num_tokens // bs
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, request.token_ids_range(i * bs, (i + 1) * bs), block_extra_key(request, i, bs)))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix, in whole blocks, always leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self.block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(hashes[:max_hit_blocks]):
            tokens = tuple(request.token_ids_range(i * self.block_size, (i + 1) * self.block_size))
            block = self.pool.lookup(block_hash, tokens)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admitted request, not per admission attempt (retries under memory pressure)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    # -- actions ----------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_tokens: int, new_computed_blocks: list[KVBlock] = ()) -> list[int] | None:
        """Make the request's table cover `num_tokens` tokens; None (and no change) if blocks are short."""
        held = self.req_blocks.get(request.request_id, [])
        num_needed = cdiv(num_tokens, self.block_size) - len(held) - len(new_computed_blocks)
        revived = sum(1 for b in new_computed_blocks if b.ref_count == 0)
        if num_needed + revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(list(new_computed_blocks))
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(new_computed_blocks)
        if new_computed_blocks:
            # Hit blocks are already in the cache index: count them as registered.
            self.num_cached_blocks[request.request_id] = len(blocks)
        if num_needed > 0:
            blocks.extend(self.pool.allocate(num_needed))
        return [b.block_id for b in blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index the request's full blocks whose KV is now computed, so later prompts can share them."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        bs = self.block_size
        for i in range(start, num_full):
            self.pool.cache(blocks[i], hashes[i], tuple(request.token_ids_range(i * bs, (i + 1) * bs)),
                            hashes[i - 1] if i else ROOT_HASH)
        self.num_cached_blocks[rid] = num_full

    def free(self, request_id: ReqId) -> None:
        blocks = self.req_blocks.pop(request_id, [])
        self.pool.release(list(reversed(blocks)))
        self.req_hashes.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)

    def pin(self, request_id: ReqId, first: int, end: int) -> list[KVBlock]:
        """Blocks [first, end) of a request's table, kept (one more reference each) until `release_blocks`, so
        a copy that reads them stays valid whatever happens to the request meanwhile."""
        blocks = self.req_blocks.get(request_id, [])[first:end]
        self.pool.touch(blocks)
        return blocks

    def reserve(self, num_blocks: int) -> list[KVBlock] | None:
        """Blocks for KV that arrives before its request does; the caller's until `adopt` or `release_blocks`."""
        if num_blocks > self.pool.num_free_blocks:
            return None
        return self.pool.allocate(num_blocks)

    def release_blocks(self, blocks: list[KVBlock]) -> None:
        self.pool.release(list(reversed(blocks)))

    def adopt(self, request_id: ReqId, blocks: list[KVBlock]) -> None:
        """Reserved blocks become the request's table (their KV covers its first tokens)."""
        self.req_blocks[request_id] = list(blocks)

    def evict(self, block_ids: list[int]) -> None:
        self.pool.evict(block_ids)

    def invalidate_from(self, request_id: ReqId, first_block: int) -> None:
        """The request keeps its blocks from `first_block` on but their KV is wrong: drop them from the prefix
        index now, and index them again once recomputed."""
        self.pool.evict(self.block_ids(request_id)[first_block:])
        if self.num_cached_blocks.get(request_id, 0) > first_block:
            self.num_cached_blocks[request_id] = first_block

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()


def block_extra_key(request: Request, block_index: int, block_size: int) -> bytes:
    """Media items change what a block's placeholder tokens mean, so their hashes join the block's key."""
    if not request.mm_items:
        return b""
    start, end = block_index * block_size, (block_index + 1) * block_size
    keys = [item.mm_hash.encode() for item in request.mm_items if item.offset < end and item.offset + item.length > start]
    return b"|".join(keys)
