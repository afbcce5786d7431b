"""A transfer D gave up on may still be moving bytes into D's blocks: a one-sided write P was granted before D's
deadline, P's shared-memory copy that passed its check before D's release, D's own read past its load deadline.
D must not report the transfer ended (so its blocks are recomputed in, or freed and reused) while that happens:
the blocks are quarantined until the mover said it stopped, or its transfer has surely ended.

Two real transfer agents on loopback, over each plane; the slow mover is a real channel whose transfer starts
late (after the grant, where the plane has one). The invariant: once D reports the transfer failed, not one byte
of its blocks changes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from server_utils import data_planes, wait_for

from pdserve.ids import ReqId, TransferId
from pdserve.kv_transfer.agent import AgentConfig, TransferAgent
from pdserve.kv_transfer.data_plane import DATA_PLANES, DataPlaneError, make_data_plane
from pdserve.kv_transfer.messages import PushRegister, Release
from pdserve.kv_transfer.pull_consumer import LoadJob
from pdserve.kv_transfer.push import consumer as push_consumer
from pdserve.kv_transfer.push.specs import PushRegistration
from pdserve.kv_transfer.runtime import LoadResult

POOL_SHAPE = (8, 2, 2, 2, 16, 8)
BLOCKS = [2, 3]
LATE_S = 2.0  # the mover starts this long after it was let in, well past D's deadline
DEADLINE_S = 0.3
PUSH_DEADLINE_S = 1.0  # P's write must be let in before it, on a box loaded by other tests too
# D's read must be under way before it (after D's own grant request to P), or nothing is late and no hold
# follows. With a deadline of 0.3 s, then 1 s, and a read that simply ended LATE_S later, the suite missed the hold
# in five of its last nine runs on a loaded box (a different plane each time): the read now waits for the test,
# which lets it go once it has seen the hold, and the deadline leaves the grant three seconds.
LOAD_DEADLINE_S = 3.0

pytestmark = [pytest.mark.parametrize("plane", data_planes("shm", "tcp", "nixl", "mooncake")), pytest.mark.core]


def make_agent(name: str, plane: str, fill: float) -> TransferAgent:
    made = make_data_plane(plane, "127.0.0.1")
    made.allocate(POOL_SHAPE, torch.float32).fill_(fill)
    agent = TransferAgent(AgentConfig(engine_id=name, compat_hash="same", planes={plane: made}, push_quarantine=True))
    agent.start()
    return agent


@pytest.fixture
def agents(plane) -> Iterator[tuple[TransferAgent, TransferAgent]]:
    if plane not in DATA_PLANES:
        pytest.fail(f"the {plane} data plane's engine is not installed")
    p, d = make_agent("P", plane, 7.0), make_agent("D", plane, 0.0)
    yield p, d
    for agent in (p, d):
        agent.stop()


def slowed(channel, plane: str, op: str, gate: tuple[threading.Event, threading.Event] | None = None) -> None:
    """Delay the channel's transfers by LATE_S, or with `gate` (started, go) until the test sets `go`: after the
    owner's grant on a one-sided engine, before the copy on shm (which has no grant), before the socket transfer on
    tcp (after D's own check on a read)."""
    if plane in ("nixl", "mooncake"):
        target = "move"
    else:
        target = "read_blocks" if op == "read" else "write_blocks"
    original = getattr(channel, target)

    def late(*args, **kwargs):
        if gate is None:
            time.sleep(LATE_S)
        else:
            gate[0].set()
            if not gate[1].wait(60):
                raise TimeoutError("the test never let the transfer go")
        return original(*args, **kwargs)

    setattr(channel, target, late)


def channel_to(agent: TransferAgent, other: TransferAgent):
    return agent.rt.call_and_wait(agent.peers.peer("127.0.0.1", other.port, other.config.engine_id), 10).channel


def first_result(agent: TransferAgent, take, timeout_s: float = 90.0) -> LoadResult:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        results = take()
        if results:
            return results[0]
        time.sleep(0.02)
    raise AssertionError(f"no transfer result within {timeout_s} s")


def assert_untouched_after(d: TransferAgent, result: LoadResult, mover_ended) -> None:
    assert not result.ok
    reported = d.rt.pool[BLOCKS].clone()
    mover_ended()
    assert torch.equal(d.rt.pool[BLOCKS], reported), "bytes landed in D's blocks after D reported the transfer over"
    assert d.stats.blocks_quarantined == 0


def register(p: TransferAgent, d: TransferAgent, transfer: str, deadline_s: float) -> PushRegister:
    """D registers blocks with P; what P received."""
    d.push_consumer.expect(PushRegistration(ReqId("r"), TransferId(transfer), "127.0.0.1", p.port, "P", 0,
                                            tuple(BLOCKS), 32, "tok"), deadline_s)
    for _ in range(500):
        received = p.push_producer.take_registrations()
        if received:
            return received[0]
        time.sleep(0.01)
    raise AssertionError("P never received D's registration")


def test_a_push_given_up_on_keeps_its_blocks_until_the_producer_stopped(agents, plane):
    """P's write was let in before D's registration timed out and lands after: D reports the push failed only
    once P answered its release, which P does once none of its writes can land any more."""
    p, d = agents
    slowed(channel_to(p, d), plane, "write")
    registration = register(p, d, "t-push", PUSH_DEADLINE_S)

    def producer() -> None:
        try:
            p.push_producer.write_blocks(registration, [0, 1], BLOCKS, None)
        except DataPlaneError:
            pass  # tcp: D checks the write when its bytes come, and refuses it by then

    mover = threading.Thread(target=producer)
    mover.start()
    # Given up on, held and counted until the late write ends; over tcp nothing was let in before D gave up,
    # so nothing is held.
    if plane == "tcp":
        time.sleep(PUSH_DEADLINE_S + 0.5)
        assert d.stats.blocks_quarantined == 0
    else:
        wait_for(lambda: d.stats.blocks_quarantined == len(BLOCKS), timeout=PUSH_DEADLINE_S + LATE_S,
                 what="the granted write's blocks to be held once D gave up")
    assert_untouched_after(d, first_result(d, d.push_consumer.take_completed), lambda: mover.join(60))
    if plane != "tcp":  # tcp's write is checked by D when its bytes come, and refused by then
        assert torch.equal(d.rt.pool[BLOCKS], torch.full_like(d.rt.pool[BLOCKS], 7.0))  # the late write landed


def test_a_silent_producer_is_waited_out_for_the_in_flight_bound_only(agents, plane, monkeypatch):
    """No answer from P: the quarantine ends when a write let in before D gave up has surely ended (at once
    where none was let in; where writes come unseen, as over shared memory, after the bound)."""
    p, d = agents
    monkeypatch.setattr(push_consumer, "IN_FLIGHT_BOUND_S", 1.0)

    async def silent(message):
        await asyncio.sleep(3600)

    p._handlers[Release] = silent
    register(p, d, "t-silent", DEADLINE_S)
    result = first_result(d, d.push_consumer.take_completed, timeout_s=30)
    assert not result.ok and "no write-done" in result.error
    assert d.stats.blocks_quarantined == 0 and d.push_consumer.num_expected() == 0


def test_a_load_past_its_deadline_fails_only_once_its_read_ended(agents, plane):
    """D's own read into its blocks outlives the load's deadline (nothing cancels it midway): the load is
    reported failed only after the read stopped moving bytes."""
    p, d = agents
    p.pull_producer.hold("k", "tok", [0, 1])
    started, go = threading.Event(), threading.Event()
    slowed(channel_to(d, p), plane, "read", gate=(started, go))
    d.pull_consumer.submit(LoadJob(ReqId("r"), "127.0.0.1", p.port, "P", "k", "tok", (0, 1), tuple(BLOCKS),
                                   LOAD_DEADLINE_S))
    assert started.wait(LOAD_DEADLINE_S + 5), "the read never began: the grant came after the load's deadline"
    try:
        wait_for(lambda: d.stats.blocks_quarantined == len(BLOCKS), timeout=LOAD_DEADLINE_S + 30,
                 what="the late read's blocks to be held past the load's deadline")
        assert not d.pull_consumer.take_completed(), "the load was reported while its read was still to run"
    finally:
        go.set()
    result = first_result(d, d.pull_consumer.take_completed)
    assert d.stats.blocks_quarantined == 0  # held until the read ended, then reported
    assert_untouched_after(d, result, lambda: time.sleep(LATE_S + 1))
    assert torch.equal(d.rt.pool[BLOCKS], torch.full_like(d.rt.pool[BLOCKS], 7.0))
