"""Scheduler rollback after a remote load with damaged blocks, at the level of block tables (no model).

The end-to-end fault tests check answers; this one pins the bookkeeping that a wrong answer would come from:
a request rolled back to token 0 keeps its own blocks and must not pick up prefix-cache hits on top of them.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.outputs import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.ids import ReqId
from pdserve.kv_transfer.base import KVConnectorMetadata, KVConnectorScheduler
from pdserve.sampling_params import SamplingParams

BLOCK = 4


class StubRemoteConnector(KVConnectorScheduler):
    """Test double: says the prompt of the requests it is given arrives asynchronously from elsewhere."""

    def __init__(self, remote: set[str]) -> None:
        self.remote = remote
        self.allocated: set[str] = set()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.request_id not in self.remote or request.request_id in self.allocated:
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if request.request_id in self.remote:
            self.allocated.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(ReqId(rid), list(prompt), SamplingParams(max_tokens=4, temperature=0.0))


def _run(scheduler: Scheduler, plan: SchedulerOutput, connector: KVConnectorOutput | None = None) -> None:
    sampled = {item.request_id: 7 for item in plan.scheduled if item.sample}
    scheduler.update_from_output(plan, ModelRunnerOutput(sampled_token_ids=sampled,
                                                         connector=connector or KVConnectorOutput()))


def test_rollback_to_token_zero_keeps_the_request_blocks_and_ignores_new_prefix_hits():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK)
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), kv, StubRemoteConnector({"remote"}))
    prompt = list(range(100, 100 + 3 * BLOCK))
    scheduler.add_request(_request("local", prompt))
    scheduler.add_request(_request("remote", prompt))

    # Step 1: "local" computes the prompt; "remote" parks waiting for the same prompt's KV from elsewhere.
    plan = scheduler.schedule()
    assert [item.request_id for item in plan.scheduled] == ["local"]
    remote = scheduler.requests[ReqId("remote")]
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    own_blocks = kv.block_ids(remote.request_id)
    assert len(own_blocks) == 3 and not set(own_blocks) & set(kv.block_ids(ReqId("local")))

    # The load finishes in the same step that caches "local"'s blocks, and its first block arrived damaged.
    _run(scheduler, plan, KVConnectorOutput(finished_recving={remote.request_id}, invalid_block_ids={own_blocks[0]}))
    assert remote.num_computed_tokens == 0

    # Step 2: "remote" recomputes the whole prompt in its own blocks, though "local"'s copy is cached now.
    plan = scheduler.schedule()
    item = next(i for i in plan.scheduled if i.request_id == remote.request_id)
    assert item.start_position == 0 and len(item.token_ids) == len(prompt)
    assert item.block_ids == own_blocks
    assert kv.block_ids(remote.request_id) == own_blocks
    _run(scheduler, plan)
    assert remote.num_computed_tokens == len(prompt)

    # Nothing leaks once both end.
    scheduler.finish_requests([ReqId("local"), remote.request_id], RequestStatus.FINISHED_ABORTED)
    assert kv.num_used_blocks == 0


def test_damaged_blocks_leave_the_prefix_index_and_return_after_recompute():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK)
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), kv, StubRemoteConnector({"remote"}))
    prompt = list(range(200, 200 + 3 * BLOCK + 1))
    scheduler.add_request(_request("remote", prompt))
    plan = scheduler.schedule()
    remote = scheduler.requests[ReqId("remote")]
    own_blocks = kv.block_ids(remote.request_id)
    _run(scheduler, plan, KVConnectorOutput(finished_recving={remote.request_id}, invalid_block_ids={own_blocks[1]}))
    plan = scheduler.schedule()
    # Block 0 arrived intact and is indexed; the damaged block 1 and everything after it are not.
    probe = _request("probe", prompt)
    assert kv.get_computed_blocks(probe)[1] == BLOCK
    item = plan.scheduled[0]
    assert item.start_position == BLOCK and item.block_ids == own_blocks
    _run(scheduler, plan)
    # Recomputed, the blocks are shared again.
    assert kv.get_computed_blocks(_request("probe2", prompt))[1] == 3 * BLOCK
    scheduler.finish_requests([remote.request_id], RequestStatus.FINISHED_ABORTED)
    assert kv.num_used_blocks == 0
