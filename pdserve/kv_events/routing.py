"""The gateway's KV-aware routing, assembled: the prefix index, the listener that feeds it, the prompt tokenizer,
the `kv_aware` policy and its metrics, and the loop that keeps the subscriptions equal to the membership.

Where an instance publishes comes from, in order: what it was registered with (`--kv-events URL=ENDPOINT[,REPLAY]`,
a config entry, or `"kv_events"` in `POST /register`: vLLM serves no info endpoint), the membership record when
the registry keeps one, and a pdserve instance's own `/v1/pdserve/info`. An instance that leaves the registry
leaves the index at the next pass.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pdserve.gateway.registry import Instance, Registry
from pdserve.kv_events.config import PublisherAddress, parse_address
from pdserve.kv_events.index import PrefixIndex
from pdserve.kv_events.listener import Listener
from pdserve.kv_events.metrics import KVIndexCollector
from pdserve.kv_events.policy import KvAware
from pdserve.kv_events.prompt import PromptTokenizer, RoutedPrompt, token_ids

log = logging.getLogger(__name__)
_MEMBERSHIP_S = 0.5  # how often the subscriptions are matched to the registry


def publisher_of(instance: Instance) -> PublisherAddress | None:
    if instance.kv_events is not None:
        return instance.kv_events
    record = getattr(instance, "record", None)
    announced = getattr(record, "kv_events", None)
    if announced is not None:
        return PublisherAddress(endpoint=announced.endpoint, replay_endpoint=announced.replay_endpoint,
                                topic=announced.topic or "", block_size=getattr(announced, "block_size", None))
    caps = instance.caps
    return caps.kv_events if caps is not None else None


def parse_kv_events_flags(specs: list[str]) -> dict[str, PublisherAddress]:
    """`URL=tcp://host:port[,tcp://host:replay_port]` entries, by instance URL."""
    out = {}
    for spec in specs:
        url, sep, address = spec.partition("=")
        if not sep or not url.startswith("http"):
            raise ValueError(f"--kv-events wants INSTANCE_URL=tcp://host:port[,tcp://host:replay_port], got {spec!r}")
        out[url.rstrip("/")] = parse_address(address)
    return out


class KVRouting:
    def __init__(self, registry: Registry, tokenizer: str | None, overlap_weight: float, store_hit_weight: float,
                 capacity: int) -> None:
        self.registry = registry
        self.index = PrefixIndex(capacity, store_hit_weight)
        self.listener = Listener(self.index)
        self.collector = KVIndexCollector(self.index, self.listener)
        self.tokenizer = PromptTokenizer(tokenizer) if tokenizer else None
        if self.tokenizer is None:
            log.warning("kv_aware routing without --tokenizer: only prompts sent as token ids are routed by the "
                        "prefix index; text and chat prompts are routed by load")
        self.overlap_weight = overlap_weight
        self._task: asyncio.Task | None = None
        self._members: dict[str, PublisherAddress] | None = None

    def policy(self) -> KvAware:
        return KvAware(self.index, self.overlap_weight)

    def prompt_of(self, body: dict[str, Any]) -> RoutedPrompt:
        if self.tokenizer is not None:
            return self.tokenizer.prompt(body)
        return RoutedPrompt(token_ids(body.get("prompt")))

    def start(self) -> None:
        self.listener.start()
        self._sync()
        self._task = asyncio.create_task(self._membership_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.to_thread(self.listener.stop)

    async def _membership_loop(self) -> None:
        while True:
            await asyncio.sleep(_MEMBERSHIP_S)
            self._sync()

    def _sync(self) -> None:
        members = {}
        for instance in list(self.registry.instances.values()):
            address = publisher_of(instance)
            if address is not None:
                members[instance.url] = address
        if members != self._members:  # the listener thread is woken only for a change
            self._members = members
            self.listener.set_members(members)
