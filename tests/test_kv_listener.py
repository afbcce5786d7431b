"""The gateway's listener against pdserve's real ZMQ publisher (PUB + replay ROUTER over ipc sockets in tmp_path),
in a thread of its own and in an event loop: replay on connect, gaps from a real high-water-mark overflow,
restarts, duplicates, foreign and malformed messages, a publisher that dies or was never there, and an index built
the same either way as from the batches applied directly."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq

from pdserve.kv_events.config import KVEventsConfig, PublisherAddress
from pdserve.kv_events.index import PrefixIndex
from pdserve.kv_events import listener as listener_module
from pdserve.kv_events.listener import Listener
from pdserve.kv_events.metrics import KVIndexCollector
from pdserve.kv_events.publisher import KVEventPublisher
from pdserve.kv_events.wire import AllBlocksCleared, BlockRemoved, KVEventBatch, encode_batch
from server_utils import wait_for
from test_kv_events import BS, held, stored

# -- the listener against the real publisher ---------------------------------------------------------------
@pytest.fixture
def ipc(tmp_path):
    def config(name: str, **extra) -> KVEventsConfig:
        return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/{name}.pub",
                              replay_endpoint=f"ipc://{tmp_path}/{name}.replay", topic=f"kv@{name}", **extra)
    return config


@pytest.fixture(params=["thread", "loop"])
def listening(request):
    """Listeners in a thread of their own, or in an event loop (the gateway's way) run by a thread of the test."""
    made = []

    def make(**kwargs) -> tuple[PrefixIndex, Listener]:
        index = PrefixIndex()
        listener = Listener(index, **kwargs)
        if request.param == "thread":
            listener.start()
            made.append((listener, None))
        else:
            loop = asyncio.new_event_loop()
            runner = threading.Thread(target=loop.run_forever, daemon=True)
            runner.start()
            in_loop(loop, listener.attach, loop)
            made.append((listener, (loop, runner)))
        return index, listener

    yield make
    for listener, looping in made:
        if looping is None:
            listener.stop()
            continue
        loop, runner = looping
        in_loop(loop, listener.stop)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()


def in_loop(loop: asyncio.AbstractEventLoop, call: Callable, *args) -> Any:
    """`call(*args)` in `loop`'s thread, waited for; what it returned."""
    async def run() -> Any:
        return call(*args)
    return asyncio.run_coroutine_threadsafe(run(), loop).result(10)


def stall(listener: Listener) -> Callable[[], None]:
    """Nothing reads the listener's sockets until the call this returns: its thread stops, or its loop is blocked."""
    if listener._loop is not None:
        gate = threading.Event()
        listener._loop.call_soon_threadsafe(gate.wait, 60)
        return gate.set

    listener._stopping.set()
    listener._thread.join(5)

    def resume() -> None:
        listener._stopping.clear()
        listener.start()
    return resume


def state(listener: Listener, member: str) -> str:
    return listener.snapshot().get(member, ("absent",))[0]


def publish_blocks(publisher: KVEventPublisher, first: int, count: int) -> None:
    """`count` one-block batches, each block chained to the one before (block n holds tokens [n]*BS)."""
    for n in range(first, first + count):
        publisher.record(stored([n + 1], n if n else None, [n] * BS))
        publisher.end_step()


def chain(count: int) -> list[int]:
    return [t for n in range(count) for t in [n] * BS] + [0]


def test_late_subscriber_replays_history_then_follows_live(ipc, listening):
    publisher = KVEventPublisher(ipc("p"), block_size=BS)
    try:
        publish_blocks(publisher, 0, 5)
        wait_for(lambda: publisher.batches == 5, what="the publisher to send")
        index, listener = listening()
        listener.set_members({"p": publisher.address()})
        wait_for(lambda: held(index, chain(5), BS, "p") == 5, what="the replay")
        publish_blocks(publisher, 5, 3)
        wait_for(lambda: held(index, chain(8), BS, "p") == 8, what="live batches")
        state, counters = listener.snapshot()["p"]
        assert state == "live" and counters.replays == 1 and counters.gaps == 0
        listener.set_members({})  # it left the membership: gone from the index
        wait_for(lambda: "p" not in index.held_blocks(), what="the member to be dropped")
    finally:
        publisher.close()


@pytest.mark.parametrize("found_by", ["the next batch", "a quiet spell"])
def test_events_lost_to_the_high_water_mark_are_replayed(ipc, listening, found_by):
    """The subscriber stalls while thousands of batches are sent: past both high-water marks ZMQ drops them. The
    loss shows as a gap when the next batch comes, or, if none comes, when the quiet publisher is asked. (While
    stalled, the SUB socket's monitor may report a disconnect: the instance is then asked for a replay after
    `retry_s` whether or not the redial is reported.)"""
    publisher = KVEventPublisher(ipc("p", hwm=5), block_size=BS)
    index, listener = listening(rcvhwm=5, idle_replay_s=0.3 if found_by == "a quiet spell" else 600)
    try:
        listener.set_members({"p": publisher.address()})
        wait_for(lambda: state(listener, "p") == "live", what="the subscription")
        resume = stall(listener)  # the subscriber stalls: nothing reads its socket while thousands are sent
        publish_blocks(publisher, 0, 3000)
        wait_for(lambda: publisher.batches == 3000, timeout=60, what="the publisher to send")
        resume()
        sent = 3000
        if found_by == "the next batch":
            wait_for(lambda: listener.snapshot()["p"][1].batches > 0, what="the batches that got through")
            # A batch sent before the publisher's side learns that the stalled pipe drained is dropped too (ZMQ
            # reactivates a pipe lazily), so the publisher goes on publishing as an engine would.
            deadline = time.monotonic() + 30
            while listener.snapshot()["p"][1].gaps == 0 and time.monotonic() < deadline:
                publish_blocks(publisher, sent, 1)
                sent += 1
                time.sleep(0.05)
        try:
            wait_for(lambda: held(index, chain(sent), BS, "p") >= sent, timeout=60, what="a replay to fill the gap")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {held(index, chain(sent), BS, 'p')} of {sent} blocks held, "
                                 f"listener {listener.snapshot()}") from None
        if found_by == "the next batch":
            assert listener.snapshot()["p"][1].gaps >= 1
    finally:
        publisher.close()


def test_a_quiet_publisher_is_probed_on_one_replay_connection(ipc, listening):
    """The probes of a quiet publisher go on the connection its last answer came on: dialling a fresh one for
    each cost both sides a connection's setup and teardown every few seconds."""
    publisher = KVEventPublisher(ipc("p"), block_size=BS)
    try:
        publish_blocks(publisher, 0, 2)
        index, listener = listening(idle_replay_s=0.1)
        listener.set_members({"p": publisher.address()})
        wait_for(lambda: publisher.replays >= 1 and state(listener, "p") == "live", what="the first replay")
        dealer = listener._subs["p"].dealer
        assert dealer is not None
        # Read between two probes: a probe in flight holds the state at "replaying" until its end marker is read.
        wait_for(lambda: publisher.replays >= 5 and state(listener, "p") == "live", what="the quiet publisher probed")
        assert listener._subs["p"].dealer is dealer
        publish_blocks(publisher, 2, 1)
        wait_for(lambda: held(index, chain(3), BS, "p") == 3, what="a live batch after the probes")
        assert listener.snapshot()["p"][1].gaps == 0
    finally:
        publisher.close()


def test_a_restarted_publisher_is_rebuilt_and_a_dead_one_scored_by_load(ipc, listening):
    config = ipc("p")
    publisher = KVEventPublisher(config, block_size=BS)
    index, listener = listening()
    listener.set_members({"p": publisher.address()})
    publish_blocks(publisher, 0, 4)
    wait_for(lambda: held(index, chain(4), BS, "p") == 4, what="the first engine's blocks")
    publisher.close()  # the engine dies: its blocks must not be credited any more
    wait_for(lambda: "p" not in index.held_blocks(), what="the dead publisher to be dropped")
    publisher = KVEventPublisher(config, block_size=BS)  # restarted: sequence from 0, another cache
    try:
        publisher.record(stored([77], None, [9] * BS))
        publisher.end_step()
        wait_for(lambda: held(index, [9] * BS + [0], BS, "p") == 1, what="the new engine's blocks")
        assert held(index, chain(4), BS, "p") == 0
        assert listener.snapshot()["p"][1].disconnects >= 1
    finally:
        publisher.close()


def test_duplicated_foreign_and_malformed_messages(ipc, listening, tmp_path):
    """A raw PUB socket speaks for the publisher: a batch sent twice, frames that are no batch, a payload that is
    no msgpack; the replay endpoint is absent, so every repair is a clear of that instance."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"ipc://{tmp_path}/raw.pub")
    index, listener = listening()
    try:
        listener.set_members({"p": PublisherAddress(endpoint=f"ipc://{tmp_path}/raw.pub")})
        wait_for(lambda: state(listener, "p") == "live", what="the subscription")

        def send(seq: int, events) -> None:
            pub.send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(KVEventBatch(time.time(), events))])

        time.sleep(0.3)  # a SUB's subscription reaches a PUB a moment after it connects
        send(0, [stored([1], None, [0] * BS)])
        send(1, [stored([2], 1, [1] * BS)])
        wait_for(lambda: held(index, chain(2), BS, "p") == 2, what="two blocks")
        send(1, [stored([2], 1, [1] * BS)])  # the same batch again: the sequence went back
        pub.send_multipart([b"not", b"a batch"])  # foreign framing: ignored
        pub.send_multipart([b"", (2).to_bytes(8, "big"), b"\xc1"])  # undecodable: the instance is cleared
        send(3, [stored([5], None, [7] * BS)])
        wait_for(lambda: held(index, [7] * BS + [0], BS, "p") == 1, what="the batch after the bad one")
        counters = listener.snapshot()["p"][1]
        assert counters.restarts == 1 and counters.decode_errors == 2
        assert held(index, chain(2), BS, "p") == 0  # cleared, never credited from a broken stream
    finally:
        ctx.destroy(linger=0)


def test_an_unreachable_publisher_is_never_an_error(tmp_path, ipc, listening):
    """A publisher nobody answers at, and an endpoint ZMQ refuses outright (a membership record carries whatever it
    was given): neither is subscribed to as live, and the listener goes on serving the others."""
    index, listener = listening(replay_timeout_s=0.3, retry_s=0.2)
    listener.set_members({"gone": PublisherAddress(endpoint=f"ipc://{tmp_path}/nobody.pub",
                                                   replay_endpoint=f"ipc://{tmp_path}/nobody.replay"),
                          "bad": PublisherAddress(endpoint="tcp://no-port-here")})
    time.sleep(0.5)
    assert state(listener, "gone") == "connecting" and index.held_blocks() == {}
    assert "bad" not in listener.snapshot()
    publisher = KVEventPublisher(ipc("ok"), block_size=BS)
    try:
        listener.set_members({"ok": publisher.address(), "bad": PublisherAddress(endpoint="tcp://no-port-here")})
        wait_for(lambda: state(listener, "ok") == "live", what="a good publisher beside a refused one")
    finally:
        publisher.close()


def test_the_index_mirrors_an_engine_prefix_cache(make_llm, llama_dir, ipc, listening):
    """An engine whose cache is too small for its prompts stores, evicts and resets blocks; the index built from
    its events holds exactly what its block pool holds, keyed so that a prompt's cached prefix is found."""
    from pdserve.sampling_params import SamplingParams
    from conftest import random_prompt

    llm = make_llm(llama_dir, num_kv_blocks=40, max_model_len=256)
    publisher = KVEventPublisher(ipc("engine"), block_size=16)
    llm.engine.publish_kv_events(publisher)
    index, listener = listening()
    listener.set_members({"engine": publisher.address()})
    try:
        prompts = [random_prompt(100, seed) for seed in range(8)]  # 6 full blocks each: 48 > 40 blocks
        llm.generate([p + [7] * 20 for p in prompts[:2]] + prompts, SamplingParams(max_tokens=4, temperature=0))
        pool = llm.engine.kv.pool
        assert publisher.dropped == 0
        wait_for(lambda: index.held_blocks().get("engine") == len(pool.cached), what="the index to match the pool")
        assert held(index, prompts[-1] + [1], 16, "engine") == 6  # the newest prompt is still cached
        assert held(index, prompts[0] + [1], 16, "engine") < 6  # the oldest lost blocks to eviction
        assert index.stats.events["BlockRemoved"] > 0 and index.stats.orphans == 0
        llm.engine.kv.reset_prefix_cache()
        llm.generate([prompts[1]], SamplingParams(max_tokens=1))
        wait_for(lambda: index.held_blocks().get("engine") == len(pool.cached) == 6, what="a reset, then one prompt")
        assert index.stats.events["AllBlocksCleared"] == 1
    finally:
        publisher.close()


def random_steps(rng: random.Random, count: int) -> list[list]:
    """An engine's batches: chains stored (often under a block it holds), one-block removals, now and then a clear.
    Few token values, so that the same contents recur under other hashes and parents."""
    steps, held_hashes, next_hash = [], [], 1
    for _ in range(count):
        events = []
        for _ in range(rng.randint(1, 4)):
            roll = rng.random()
            if roll < 0.5 or not held_hashes:
                parent = rng.choice(held_hashes) if held_hashes and rng.random() < 0.6 else None
                hashes = list(range(next_hash, next_hash + rng.randint(1, 3)))
                next_hash += len(hashes)
                events.append(stored(hashes, parent, [rng.randrange(3) for _ in range(len(hashes) * BS)]))
                held_hashes += hashes
            elif roll < 0.97:
                events.append(BlockRemoved(block_hashes=[held_hashes.pop(rng.randrange(len(held_hashes)))],
                                           medium="GPU"))
            else:
                events.append(AllBlocksCleared())
                held_hashes.clear()
        steps.append(events)
    return steps


def test_the_listener_builds_the_index_its_batches_build_applied_directly(ipc, listening):
    """400 random batches: 300 sent before the listener subscribes (a replay of several turns' budget), the rest
    live in one burst. The index ends exactly as one that applied the same batches itself: the same holders, LRU
    order and counts (compared inside: overlaps alone could hide an entry applied twice or out of order)."""
    steps = random_steps(random.Random(5), 400)
    reference = PrefixIndex()
    for events in steps:
        reference.apply("p", events)
    publisher = KVEventPublisher(ipc("p"), block_size=BS)
    try:
        for events in steps[:300]:
            publisher.publish(events)
        wait_for(lambda: publisher.batches == 300, what="the publisher to send")
        index, listener = listening()
        listener.set_members({"p": publisher.address()})
        wait_for(lambda: state(listener, "p") == "live", what="the replay")
        time.sleep(0.3)  # a SUB's subscription reaches a PUB a moment after it connects (a loss would be replayed)
        for events in steps[300:]:
            publisher.publish(events)
        wait_for(lambda: listener.snapshot()["p"][1].batches == 400, what="every batch applied")
        lru = [i.lru_items() for i in (index, reference)]
        assert index._holders == reference._holders and lru[0] == lru[1]
        assert index.stats.events == reference.stats.events and index.stats.orphans == reference.stats.orphans
    finally:
        publisher.close()


@contextmanager
def sent_unread(ipc, listening, monkeypatch, count: int) -> Iterator[tuple[PrefixIndex, Listener]]:
    """A live subscription to a publisher that has sent `count` chained one-block batches, with the loop's timer,
    which would otherwise read them between picks, out of the way."""
    monkeypatch.setattr(listener_module, "_LOOP_TICK_S", 600.0)
    publisher = KVEventPublisher(ipc("p"), block_size=BS)
    index, listener = listening()
    try:
        listener.set_members({"p": publisher.address()})
        wait_for(lambda: state(listener, "p") == "live", what="the subscription")
        time.sleep(0.3)  # a SUB's subscription reaches a PUB a moment after it connects
        publish_blocks(publisher, 0, count)
        wait_for(lambda: publisher.batches == count, what="the publisher to send")
        time.sleep(0.3)
        yield index, listener
    finally:
        publisher.close()


def test_in_a_loop_live_batches_are_read_when_the_index_is_about_to_be_read(ipc, listening, monkeypatch):
    """In the gateway's loop the live sockets are not watched: `catch_up` (before each pick) reads them. With the
    timer that otherwise reads them between picks out of the way, `catch_up` alone brings every batch in."""
    with sent_unread(ipc, listening, monkeypatch, 100) as (index, listener):  # more than one turn's budget
        if listener._loop is None:
            pytest.skip("a listener in its own thread reads every batch as it comes")
        assert listener.snapshot()["p"][1].batches == 0  # nothing read them yet

        def caught_up() -> float:
            in_loop(listener._loop, listener.catch_up)
            return held(index, chain(100), BS, "p")
        wait_for(lambda: caught_up() == 100, what="catch_up to read every batch")


def test_a_scrape_reads_the_batches_that_came_since_the_last_pick(ipc, listening, monkeypatch):
    """`/metrics` right after a request shows its blocks: the collector catches up first, as a pick does."""
    with sent_unread(ipc, listening, monkeypatch, 5) as (index, listener):
        def scrape() -> dict[str, float]:
            [blocks] = [f for f in KVIndexCollector(index, listener).collect()
                        if f.name == "pdserve:gateway_kv_index_blocks"]
            return {s.labels["instance"]: s.value for s in blocks.samples}
        if listener._loop is None:
            wait_for(lambda: scrape().get("p") == 5, what="the thread to read the batches")
        else:
            assert in_loop(listener._loop, scrape) == {"p": 5.0}
