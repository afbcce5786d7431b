"""`--policy kv_aware`: route by where the prompt's prefix is cached and by load, with Dynamo's cost.

    cost = w × prefill (tokens queued on the instance + this prompt's tokens it does not hold)
           + active KV (tokens the instance's requests in flight hold)

lowest wins (ties go round): Dynamo's `overlap_score_weight × potential prefill blocks + decode blocks`. Dynamo counts in blocks of one size; here instances may use different block sizes (vLLM-CPU 32–128,
pdserve 16), so everything is counted in tokens, which changes no choice where sizes agree. The cached part is the
longest run of the prompt's blocks from its start that the index credits to the instance (a device-cache copy
whole, a copy in another tier at its weight). The queued and active parts are the gateway's own count over its
legs in flight there (`Instance.pending_tokens` until a leg's first token, `Instance.active_tokens` while it
lasts, each leg counting only the tokens the instance did not hold), so a request that shares a prefix with work
already on an instance adds little load there. `w` is `--kv-overlap-weight`, 2 by default where Dynamo's is 1:
an instance streaming the answer to a prompt it has just computed keeps that prompt in its active KV until the
answer ends, so at 1 it looked as busy as recomputing the prompt elsewhere would be, and the next prompts that
shared the prefix went where it was not. 0 routes by load alone. An instance
whose events the gateway does not have (no publisher, or one it cannot reach) holds nothing by the index. The
chosen instance is credited with the prompt's blocks at once, so a burst of requests with one prefix finds it
before the instance's events arrive.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

from pdserve.gateway.policies import Policy
from pdserve.gateway.registry import Instance
from pdserve.kv_events.index import PrefixIndex
from pdserve.kv_events.prompt import RoutedPrompt

log = logging.getLogger(__name__)


class KvAware(Policy):
    name = "kv_aware"
    wants_prompt = True

    def __init__(self, index: PrefixIndex, overlap_weight: float = 2.0, catch_up: Callable[[], None] | None = None
                 ) -> None:
        """`catch_up`: brings the index up to the events received so far (the listener's, when it reads them only
        when asked)."""
        self.index = index
        self.overlap_weight = overlap_weight
        self.catch_up = catch_up
        self._tiebreak = itertools.count()

    def pick(self, candidates: list[Instance], affinity: bytes = b"", prompt: RoutedPrompt | None = None) -> Instance:
        start = next(self._tiebreak) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        if prompt is None or prompt.tokens is None:
            return min(rotated, key=lambda i: (i.pending_tokens + i.active_tokens, i.in_flight))
        if self.catch_up is not None:
            self.catch_up()
        cached = self.cached_tokens(rotated, prompt)
        n = prompt.num_tokens
        w = self.overlap_weight

        def cost(i: Instance) -> float:
            return w * (i.pending_tokens + n - cached[i.url]) + i.active_tokens

        chosen = min(rotated, key=cost)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("kv_aware: %d prompt tokens to %s; %s", n, chosen.url, "; ".join(
                f"{i.url} held {cached[i.url]:.0f} queued {i.pending_tokens} active {i.active_tokens} cost {cost(i):.0f}"
                for i in candidates))
        prompt.cached[chosen.url] = cached[chosen.url]
        size = self.index.block_size(chosen.url)
        if size:
            self.index.credit(chosen.url, prompt.keys(size), size)
        return chosen

    def cached_tokens(self, candidates: list[Instance], prompt: RoutedPrompt) -> dict[str, float]:
        """Prompt tokens each candidate holds, by the index (0 for those it knows nothing of)."""
        by_size: dict[int, list[str]] = {}
        for instance in candidates:
            by_size.setdefault(self.index.block_size(instance.url), []).append(instance.url)
        out: dict[str, float] = {}
        for size, members in by_size.items():
            if not size:
                out.update(dict.fromkeys(members, 0.0))
                continue
            blocks = self.index.overlap_blocks(prompt.keys(size), size, members)
            out.update({member: credit * size for member, credit in blocks.items()})
        return out
