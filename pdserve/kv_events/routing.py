"""The gateway's KV-aware routing, assembled: the prefix index, the listener that feeds it, the prompt tokenizer,
the `kv_aware` policy and its metrics, and the loop that keeps the subscriptions equal to the membership.

Where an instance publishes comes from its membership record's `kv_events` (vLLM serves no info endpoint: the
record is built from `--kv-events URL=ENDPOINT[,REPLAY]` or a config entry, from `"kv_events"` in `POST /register`,
from `pdserve register --kv-events-config` or the sidecar), else from a pdserve instance's own `/v1/pdserve/info`.
A bound endpoint in a record (vLLM's `tcp://*:5557`) is dialled at the instance's own host. An instance that leaves
the registry leaves the index at the next pass.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

import msgspec

from pdserve.gateway.registry import Instance, Registry
from pdserve.kv_events.config import PublisherAddress, dial_address, parse_address
from pdserve.kv_events.index import PrefixIndex
from pdserve.kv_events.listener import Listener
from pdserve.kv_events.metrics import KVIndexCollector
from pdserve.kv_events.policy import KvAware
from pdserve.kv_events.prompt import PromptTokenizer, RoutedPrompt, token_ids
from pdserve.membership.record import KvEvents, normalise_url

log = logging.getLogger(__name__)
# How often the subscriptions are matched to the registry. A departed instance is never routed to meanwhile (picks
# choose among the registry's instances); a new one is scored by load until its subscription starts.
_MEMBERSHIP_S = 1.0


def publisher_of(instance: Instance) -> PublisherAddress | None:
    announced = instance.record.kv_events if instance.record is not None else None
    if announced is not None:
        host = urlsplit(instance.url).hostname or "127.0.0.1"
        spec = dial_address(announced.endpoint, host)
        if announced.replay_endpoint:
            spec += "," + dial_address(announced.replay_endpoint, host)
        try:
            address = parse_address(spec)
        except ValueError:  # a record carries what it was given: nothing to subscribe to, so routed by load
            return None
        return msgspec.structs.replace(address, topic=announced.topic)
    caps = instance.caps
    return caps.kv_events if caps is not None else None


def parse_kv_events_flags(specs: list[str]) -> dict[str, KvEvents]:
    """`URL=tcp://host:port[,tcp://host:replay_port]` entries, by instance URL, as membership records carry them."""
    out = {}
    for spec in specs:
        url, sep, address = spec.partition("=")
        if not sep or not url.startswith("http"):
            raise ValueError(f"--kv-events wants INSTANCE_URL=tcp://host:port[,tcp://host:replay_port], got {spec!r}")
        parsed = parse_address(address)
        out[normalise_url(url)] = KvEvents(endpoint=parsed.endpoint, replay_endpoint=parsed.replay_endpoint)
    return out


class KVRouting:
    def __init__(self, registry: Registry, tokenizer: str | None, overlap_weight: float, store_hit_weight: float,
                 capacity: int) -> None:
        self.registry = registry
        self.index = PrefixIndex(capacity, store_hit_weight)
        if not self.index.native:
            log.info("the KV index applies events with its Python core: the C core is not built on this machine "
                     "(python -m pdserve.kv_events.native builds it)")
        self.listener = Listener(self.index)
        self.collector = KVIndexCollector(self.index, self.listener)
        self.tokenizer = PromptTokenizer(tokenizer, self.index.keys_of) if tokenizer else None
        if self.tokenizer is None:
            log.warning("kv_aware routing without --tokenizer: only prompts sent as token ids are routed by the "
                        "prefix index; text and chat prompts are routed by load")
        self.overlap_weight = overlap_weight
        self._task: asyncio.Task | None = None
        self._members: dict[str, PublisherAddress] | None = None

    def policy(self) -> KvAware:
        return KvAware(self.index, self.overlap_weight, self.listener.catch_up)

    def prompt_of(self, body: dict[str, Any]) -> RoutedPrompt:
        if self.tokenizer is not None:
            return self.tokenizer.prompt(body)
        return RoutedPrompt(token_ids(body.get("prompt")), keys_of=self.index.keys_of)

    def start(self) -> None:
        """From the event loop, which the listener then runs in."""
        self.listener.attach(asyncio.get_running_loop())
        self._sync()
        self._task = asyncio.create_task(self._membership_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.listener.stop()

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
        if members != self._members:  # the listener is told only of a change
            self._members = members
            self.listener.set_members(members)
