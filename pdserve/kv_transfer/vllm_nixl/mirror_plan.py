"""The scheduler's side of the vLLM mirror: which mirror blocks each prefill for a vLLM decoder gets, and when.

Mirror blocks are vLLM-sized (128 tokens by default) and numbered in the mirror pool only. A prompt gets its
blocks in the step that finishes its prefill (that step's worker copies the KV in before the answer naming them
leaves) and keeps them until vLLM's read-done notification or the lease ends the hold, or, if the request never
hands off, until it finishes. Block ids only: the worker owns the tensors.
"""

from __future__ import annotations

import logging

from pdserve.engine.outputs import ScheduledRequest
from pdserve.ids import ReqId
from pdserve.kv_transfer.vllm_nixl.producer import MirrorFill
from pdserve.utils import cdiv

log = logging.getLogger(__name__)


class MirrorPlan:
    def __init__(self, num_blocks: int, block_size: int, pool_block_size: int) -> None:
        self.block_size = block_size
        self.pool_block_size = pool_block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self._taken: dict[ReqId, tuple[int, ...]] = {}

    def plan_fill(self, item: ScheduledRequest) -> MirrorFill | None:
        """On the step that samples the prompt's first token, the mirror blocks to copy it into (once)."""
        if not item.sample or item.request_id in self._taken:
            return None
        num_tokens = len(item.prompt_token_ids)
        needed = cdiv(num_tokens, self.block_size)
        if needed > len(self._free):
            log.warning("no room in the vLLM mirror for request %s (%d blocks needed, %d free): it hands off no KV",
                        item.request_id, needed, len(self._free))
            self._taken[item.request_id] = ()
            return None
        ids = tuple(self._free.pop() for _ in range(needed))
        self._taken[item.request_id] = ids
        return MirrorFill(tuple(item.block_ids[:cdiv(num_tokens, self.pool_block_size)]), ids, num_tokens)

    def blocks_of(self, rid: ReqId) -> tuple[int, ...]:
        """The mirror blocks filled for this request (empty if none)."""
        return self._taken.get(rid, ())

    def free(self, rid: ReqId) -> None:
        self._free.extend(self._taken.pop(rid, ()))

    def num_held(self) -> int:
        return sum(len(ids) for ids in self._taken.values())
