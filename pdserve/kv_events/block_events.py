"""The block pool's side of KV events: what entered and left the prefix cache, as vLLM's events.

The pool calls `stored` for each block it indexes, `removed` when a block's hash is forgotten (evicted for reuse,
known bad) and `cleared` on a reset; the engine calls `end_step` after each step, which hands the step's events
to the publisher as one batch. Consecutive blocks of one prompt indexed in one step become one `BlockStored`, as
vLLM sends them (one event per request and step, its parent the block before the first).

pdserve's block hashes are 16-byte digests; they go out as vLLM sends its own by default, the low 64 bits as an
unsigned integer. Subscribers use them only to apply removals and find parents, never to compare instances.
"""

from __future__ import annotations

from pdserve.kv_events.publisher import KVEventPublisher
from pdserve.kv_events.wire import MEDIUM_DEVICE, AllBlocksCleared, BlockRemoved, BlockStored


def published_hash(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")


class BlockEvents:
    def __init__(self, publisher: KVEventPublisher, block_size: int, root_hash: bytes) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self.root_hash = root_hash
        self._open: BlockStored | None = None  # the step's last BlockStored, which a next block may extend

    def stored(self, parent: bytes, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        parent_id = None if parent == self.root_hash else published_hash(parent)
        own = published_hash(block_hash)
        event = self._open
        if event is not None and parent_id is not None and event.block_hashes[-1] == parent_id:
            event.block_hashes.append(own)
            event.token_ids.extend(token_ids)
            return
        self._open = BlockStored(block_hashes=[own], parent_block_hash=parent_id, token_ids=list(token_ids),
                                 block_size=self.block_size, lora_id=None, medium=MEDIUM_DEVICE, lora_name=None)
        self.publisher.record(self._open)

    def removed(self, block_hash: bytes) -> None:
        self._open = None  # a later block must not extend an event published before this removal
        self.publisher.record(BlockRemoved(block_hashes=[published_hash(block_hash)], medium=MEDIUM_DEVICE))

    def cleared(self) -> None:
        self._open = None
        self.publisher.record(AllBlocksCleared())

    def end_step(self) -> None:
        self._open = None
        self.publisher.end_step()
