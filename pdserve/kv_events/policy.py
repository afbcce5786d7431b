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
import time
from collections import OrderedDict
from collections.abc import Callable

from pdserve.gateway.policies import Policy
from pdserve.gateway.registry import Instance
from pdserve.kv_events.index import PrefixIndex
from pdserve.kv_events.prompt import RoutedPrompt

log = logging.getLogger(__name__)


class KvAware(Policy):
    name = "kv_aware"
    wants_prompt = True

    def __init__(self, index: PrefixIndex, overlap_weight: float = 2.0, catch_up: Callable[[], None] | None = None,
                 deferred_capacity: int = 1024) -> None:
        """`catch_up`: brings the index up to the events received so far (the listener's, when it reads them only
        when asked). `deferred_capacity`: credits of new prompts kept unencoded (below), at most."""
        self.index = index
        self.overlap_weight = overlap_weight
        self.catch_up = catch_up
        self.deferred_capacity = deferred_capacity
        self._tiebreak = itertools.count()
        # (block size, key of a prompt's first block nobody held) -> (instance, prompt, when): the rest of its
        # credit, encoded and given only if another prompt comes with that block
        self._deferred: OrderedDict[tuple[int, int], tuple[str, RoutedPrompt, float]] = OrderedDict()

    def pick(self, candidates: list[Instance], affinity: bytes = b"", prompt: RoutedPrompt | None = None) -> Instance:
        start = next(self._tiebreak) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        if prompt is None or not prompt.routable:
            return min(rotated, key=lambda i: (i.pending_tokens + i.active_tokens, i.in_flight))
        if self.catch_up is not None:
            self.catch_up()
        by_size: dict[int, list[str]] = {}
        for instance in rotated:
            by_size.setdefault(self.index.block_size(instance.url), []).append(instance.url)
        known = {size: self._known(prompt, size) for size in by_size if size}
        cached = self.cached_tokens(by_size, known)
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
            keys, unknown = known[size]
            if unknown is None:
                self.index.credit(chosen.url, keys, size)
            else:
                self.index.credit(chosen.url, [*keys, unknown], size)
                self._defer(size, unknown, chosen.url, prompt)
        return chosen

    def cached_tokens(self, by_size: dict[int, list[str]], known: dict[int, tuple[list[int], int | None]]
                      ) -> dict[str, float]:
        """Prompt tokens each candidate (by block size) holds, by the index (0 for those it knows nothing of)."""
        out: dict[str, float] = {}
        for size, members in by_size.items():
            if not size:
                out.update(dict.fromkeys(members, 0.0))
                continue
            blocks = self.index.overlap_blocks(known[size][0], size, members)
            out.update({member: credit * size for member, credit in blocks.items()})
        return out

    # -- how far a prompt is read ------------------------------------------------------------------------
    def _known(self, prompt: RoutedPrompt, size: int) -> tuple[list[int], int | None]:
        """The keys routing reads, and the first block's that no instance holds or is credited with where the
        prompt was read no further (else None). A prompt that encodes lazily is first read as far as the pieces
        it has met before (a template, a system prompt) and a head of the first new one: if a block there is
        unknown, no instance's cached run goes past it, and the rest is not encoded (a prompt that shares nothing
        with any cache, behind a template or not). Otherwise it is read whole, as a prompt whose ids came known."""
        if not prompt.exact:
            head = prompt.head_keys(size, 1)
            done = self.index.known_run(head, 0, size)
            if done == len(head) and not prompt.exact:  # all known so far: a head of the next new piece too
                head = prompt.head_keys(size, len(head) + 2)
                done += self.index.known_run(head, done, size)
            if done < len(head) and not prompt.exact and not (done and self._complete(size, head[done - 1])):
                return head[:done], head[done]
        keys = prompt.keys(size)
        done = self.index.known_run(keys, 0, size)
        if 0 < done < len(keys):  # a burst's deferred credit further in
            self._complete(size, keys[done - 1])
        return keys, None

    def _defer(self, size: int, key: int, member: str, prompt: RoutedPrompt) -> None:
        """`prompt` went to `member`, credited up to its first block nobody held (`key`, included): the credit of
        the rest waits, unencoded, for a later prompt that comes with that block before `member`'s events do (a
        burst with one new prefix). Once they come (the credit of `key` confirmed or lapsed), it is void. Entries
        live as long as a credit does, and at most `deferred_capacity` of them (each holds its prompt's text)."""
        deferred, now = self._deferred, time.monotonic()
        while deferred and (len(deferred) >= self.deferred_capacity
                            or next(iter(deferred.values()))[2] < now - self.index.speculative_ttl_s):
            deferred.popitem(last=False)
        deferred[(size, key)] = (member, prompt, now)

    def _complete(self, size: int, key: int) -> bool:
        """Give the credit deferred after the block with this key, if it is still due (encoding that prompt
        now); whether one was given."""
        entry = self._deferred.pop((size, key), None)
        if entry is None or not self.index.guessed(entry[0], key, size):
            return False
        member, prompt, _ = entry
        self.index.credit(member, prompt.keys(size), size)
        return True
