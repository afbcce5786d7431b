"""One subscription of the gateway's KV-event listener: its sockets, where it stands, and its counters (plain
values, read by the metrics from another thread)."""

from __future__ import annotations

from dataclasses import dataclass, field

import zmq

from pdserve.kv_events.config import PublisherAddress


@dataclass
class Counters:
    gaps: int = 0
    replays: int = 0
    restarts: int = 0
    decode_errors: int = 0
    batches: int = 0
    disconnects: int = 0


@dataclass(eq=False)
class Subscription:
    member: str
    address: PublisherAddress
    sub: zmq.Socket
    monitor: zmq.Socket
    dealer: zmq.Socket | None = None
    answered: bool = False  # the dealer's last request has had its end marker: it can carry the next one
    state: str = "connecting"  # connecting, replaying, live, degraded
    hole: bool = False  # the running replay skipped some batches: the rest of it is ignored and it is asked again
    replayed: int = 0  # batches the running replay brought
    next_seq: int | None = None  # the next live batch expected
    held: list[tuple[int, bytes]] = field(default_factory=list)  # live batches received during a replay
    deadline: float = 0.0  # of the running replay, or when a degraded instance tries again
    counters: Counters = field(default_factory=Counters)
