"""vLLM's step schedule as PdConnector's scheduler half reads it: the chunks of the requests that push (their
prompt) or that the store tier writes (prompt and output).

pdserve's scheduler gives its connector every scheduled chunk with the request's whole block table; vLLM's
`SchedulerOutput` names a request's block table once, when it is first scheduled, and after that only the blocks
added each step. This keeps the block tables of the requests that need them from those diffs and writes their
chunks in pdserve's shape, so pdserve's own code plans the push writes and the store writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdserve.engine.outputs import ScheduledRequest, SchedulerOutput
from pdserve.ids import ReqId
from pdserve.sampling_params import SamplingParams


class PushSchedule:
    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}  # request id -> its whole block table (first KV group)

    def scheduler_output(self, out: Any, tokens_of: Callable[[str], list[int] | None]) -> SchedulerOutput:
        """pdserve's view of vLLM's step `out`: the chunks of requests `tokens_of` names tokens for (a pushing
        request's prompt: tokens past it are nobody's to push; a stored request's prompt and output) that compute
        some of those tokens."""
        starts: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            if tokens_of(new.req_id) is not None:
                self._tables[new.req_id] = list(new.block_ids[0])
                starts[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            table = self._tables.get(rid)
            if table is None:
                continue
            added = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted and rescheduled: a fresh block table
                table.clear()
            if added is not None:
                table.extend(added[0])
            starts[rid] = cached.num_computed_tokens[i]
        step = SchedulerOutput()
        for rid, start in starts.items():
            prompt = tokens_of(rid) or []
            end = min(start + out.num_scheduled_tokens.get(rid, 0), len(prompt))
            if start >= end:
                continue
            step.scheduled.append(ScheduledRequest(
                request_id=ReqId(rid), token_ids=prompt[start:end], start_position=start,
                block_ids=self._tables[rid], sample=end == len(prompt), sampling_params=SamplingParams(),
                prompt_token_ids=prompt, output_token_ids=[]))
        return step

    def forget(self, request_id: str) -> None:
        self._tables.pop(request_id, None)
