"""The sources of an instance's KV events, as vLLM's events: the prefix cache, and the shared KV store tier.

The pool calls `stored` for each block it indexes, `removed` when a block's hash is forgotten (evicted for reuse,
known bad) and `cleared` on a reset; the engine calls `end_step` after each step, which hands the step's events
to the publisher as one batch. Consecutive blocks of one prompt indexed in one step become one `BlockStored`, as
vLLM sends them (one event per request and step, its parent the block before the first). Consecutive removals
become one `BlockRemoved` listing every hash in order, which the wire allows and every subscriber reads: vLLM sends
one event per evicted block, and a step that makes room for a new prompt evicts a dozen or more, each of which a
subscriber would otherwise decode and apply on its own.

The store tier announces the blocks a store took, from its writer thread (`KVStoreTier.on_stored`): they go out
at once as a batch of their own, `BlockStored` with medium "STORAGE", chained by the store's own block hashes.
The store evicts and expires entries without telling anyone, so no removal follows them.

pdserve's block hashes are 16-byte digests; they go out as vLLM sends its own by default, the low 64 bits as an
unsigned integer. Subscribers use them only to apply removals and find parents, never to compare instances.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.kv_events.publisher import KVEventPublisher
from pdserve.kv_events.wire import MEDIUM_DEVICE, MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored

if TYPE_CHECKING:
    from pdserve.kv_store.tier import StoredBlock


def published_hash(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")


def extended(last: BlockStored | None, parent_id: int | None, own: int, token_ids: tuple[int, ...]) -> bool:
    """Add the block to `last` when it follows `last`'s final block; False when it needs an event of its own."""
    if last is None or parent_id is None or last.block_hashes[-1] != parent_id:
        return False
    last.block_hashes.append(own)
    last.token_ids.extend(token_ids)
    return True


class BlockEvents:
    def __init__(self, publisher: KVEventPublisher, block_size: int, root_hash: bytes) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self.root_hash = root_hash
        # The step's last event, which the next one extends when it is of the same kind (a block following a
        # BlockStored's last, or another removal): a later event never joins one published before something else.
        self._last: BlockStored | BlockRemoved | None = None

    def stored(self, parent: bytes, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        parent_id = None if parent == self.root_hash else published_hash(parent)
        own = published_hash(block_hash)
        if isinstance(self._last, BlockStored) and extended(self._last, parent_id, own, token_ids):
            return
        self._last = BlockStored(block_hashes=[own], parent_block_hash=parent_id, token_ids=list(token_ids),
                                 block_size=self.block_size, lora_id=None, medium=MEDIUM_DEVICE, lora_name=None)
        self.publisher.record(self._last)

    def removed(self, block_hash: bytes) -> None:
        if isinstance(self._last, BlockRemoved):
            self._last.block_hashes.append(published_hash(block_hash))
            return
        self._last = BlockRemoved(block_hashes=[published_hash(block_hash)], medium=MEDIUM_DEVICE)
        self.publisher.record(self._last)

    def cleared(self) -> None:
        self._last = None
        self.publisher.record(AllBlocksCleared())

    def end_step(self) -> None:
        self._last = None
        self.publisher.end_step()


class StoreEvents:
    """`KVStoreTier.on_stored`'s listener: the blocks a store took, as one batch. `root_hash`: the store chain's
    root (the key namespace's digest), whose children have no parent on the wire."""

    def __init__(self, publisher: KVEventPublisher, block_size: int, root_hash: bytes) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self.root_hash = root_hash

    def stored(self, blocks: list[StoredBlock]) -> None:
        events: list[BlockStored] = []
        for block in blocks:
            parent_id = None if block.parent == self.root_hash else published_hash(block.parent)
            own = published_hash(block.block_hash)
            if not extended(events[-1] if events else None, parent_id, own, block.token_ids):
                events.append(BlockStored(block_hashes=[own], parent_block_hash=parent_id,
                                          token_ids=list(block.token_ids), block_size=self.block_size, lora_id=None,
                                          medium=MEDIUM_STORAGE, lora_name=None))
        if events:
            self.publisher.publish(events)
