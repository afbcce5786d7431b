"""KV events without a model: vLLM's encodings decoded by name, the dual-key prefix index, and the gateway's
listener against pdserve's real ZMQ publisher (PUB + replay ROUTER over ipc sockets in tmp_path): replay on
connect, gaps from a real high-water-mark overflow, restarts, duplicates, foreign and malformed messages, a
publisher that dies or was never there."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from pdserve.kv_events.config import KVEventsConfig, PublisherAddress, parse_address, parse_config
from pdserve.kv_events.index import PrefixIndex, content_keys
from pdserve.kv_events.listener import Listener
from pdserve.kv_events.publisher import KVEventPublisher
from pdserve.kv_events.wire import (AllBlocksCleared, BlockRemoved, BlockStored, EventDecodeError, decode_batch,
                                    encode_batch, KVEventBatch)
from server_utils import wait_for

BS = 4


def stored(hashes, parent, tokens, bs=BS, medium="GPU"):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=bs, lora_id=None,
                       medium=medium, lora_name=None)


def held(index: PrefixIndex, tokens: list[int], bs: int, member: str) -> float:
    return index.overlap_blocks(content_keys(tokens, bs), bs, [member])[member]


# -- the wire -----------------------------------------------------------------------------------------------
def test_both_encodings_decode_by_field_name_with_defaults_omitted_and_unknown_fields_ignored():
    tagged = msgspec.msgpack.encode([1.5, [
        {"type": "BlockStored", "block_hashes": [2**64 - 1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
         "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "a_field_from_the_future": [1]},
        {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32]},  # medium omitted (a foreign publisher)
        {"type": "AllBlocksCleared"}], 0])
    positional = msgspec.msgpack.encode([1.5, [
        ["BlockStored", [-1], None, [1, 2, 3, 4], 4, None, "GPU"],  # lora_name and later fields omitted
        ["BlockRemoved", [b"\x01" * 32], "CPU", 0],
        ["AllBlocksCleared"]]])
    for payload in (tagged, positional):
        batch = decode_batch(payload)
        first, second, third = batch.events
        assert isinstance(first, BlockStored) and first.token_ids == [1, 2, 3, 4] and first.block_size == 4
        assert first.lora_name is None and first.extra_keys is None
        assert isinstance(second, BlockRemoved) and second.block_hashes == [b"\x01" * 32]
        assert isinstance(third, AllBlocksCleared)
    assert decode_batch(positional).events[1].medium == "CPU"


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode("text"), msgspec.msgpack.encode([1.0, 7]),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockMoved"}]]),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
                                     msgspec.msgpack.encode([1.0, [42]])])
def test_malformed_payloads_are_refused_with_a_reason(payload):
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_config_is_read_as_vllm_reads_it():
    assert not parse_config({}).enabled
    assert parse_config({"enable_kv_cache_events": True}).enabled
    assert not parse_config({"enable_kv_cache_events": True, "publisher": "null"}).enabled
    for bad in ({"publisher": "kafka"}, {"hwm": 0}, {"endpoint": "http://x:1"}, {"not_a_field": 1}):
        with pytest.raises(ValueError):
            parse_config(bad)
    assert parse_address("tcp://h:1,tcp://h:2") == PublisherAddress(endpoint="tcp://h:1", replay_endpoint="tcp://h:2")
    with pytest.raises(ValueError):
        parse_address("http://h:1")


# -- the index ----------------------------------------------------------------------------------------------
def test_blocks_are_keyed_by_content_per_block_size_and_removed_by_engine_hash():
    index = PrefixIndex()
    tokens = list(range(100, 116))
    # Two engines, two hash schemes (signed, unsigned, digests), two block sizes: the same content key.
    index.apply("a", [stored([-5, -6], None, tokens[:8]), stored([-7], -6, tokens[8:12])])
    index.apply("b", [stored([b"x" * 32, b"y" * 32], None, tokens[:8], bs=4)])
    index.apply("c", [stored([10], None, tokens[:8], bs=8)])
    assert held(index, tokens, BS, "a") == 3 and held(index, tokens, BS, "b") == 2
    assert held(index, tokens, 8, "c") == 1 and held(index, tokens, BS, "c") == 0
    assert held(index, [0] + tokens[1:], BS, "a") == 0  # another first block: no prefix in common
    index.apply("a", [BlockRemoved(block_hashes=[2**64 - 6], medium="GPU")])  # -6 as unsigned: the same block
    assert held(index, tokens, BS, "a") == 1  # the run from the start stops at the removed block
    index.apply("a", [stored([-8], 999, tokens[:4])])  # a parent it never heard of: not indexed
    assert index.stats.orphans == 1
    index.apply("b", [AllBlocksCleared()])
    assert held(index, tokens, BS, "b") == 0 and index.held_blocks()["b"] == 0


def test_copies_are_counted_and_tiers_credited_by_weight():
    index = PrefixIndex(offload_weight=0.75)
    tokens = list(range(8))
    index.apply("a", [stored([1, 2], None, tokens), stored([1, 2], None, tokens)])  # two device copies
    index.apply("a", [BlockRemoved(block_hashes=[2], medium="GPU")])
    assert held(index, tokens, BS, "a") == 2  # one copy of block 2 is left
    index.apply("a", [stored([2], None, [], medium="STORAGE"), BlockRemoved(block_hashes=[2], medium="GPU")])
    assert held(index, tokens, BS, "a") == 1.75  # block 2 now only in the store tier
    index.apply("a", [BlockRemoved(block_hashes=[2], medium="STORAGE")])
    assert held(index, tokens, BS, "a") == 1


def test_the_same_tokens_under_two_engine_hashes_stay_held_until_both_go():
    """An engine may hold one content under two hashes (another cache salt or LoRA adapter): removing one leaves
    the instance holding the tokens, and removing the other (with copies left) does not break the index."""
    index = PrefixIndex()
    tokens = list(range(8))
    index.apply("a", [stored([1, 2], None, tokens), stored([11, 12], None, tokens), stored([12], 11, tokens[4:])])
    index.apply("a", [BlockRemoved(block_hashes=[2], medium="GPU")])
    assert held(index, tokens, BS, "a") == 2  # block 12 still holds the second block's tokens
    index.apply("a", [BlockRemoved(block_hashes=[12], medium="GPU")])  # one of its two copies
    assert held(index, tokens, BS, "a") == 2
    index.apply("a", [BlockRemoved(block_hashes=[12], medium="GPU")])
    assert held(index, tokens, BS, "a") == 1 and index.held_blocks()["a"] == 2


def test_a_shared_stores_blocks_are_credited_to_its_readers_and_outlive_their_writer():
    """"STORAGE" blocks of an instance that announced a store belong to the store: every reader of that store is
    credited at the store weight (its own device copy counts whole), an instance of no store or another store
    gets nothing, the writer's reset or departure keeps them, and the last reader's departure drops them."""
    index = PrefixIndex(offload_weight=0.75)
    tokens = list(range(12))
    for member, store in (("a", "redis://s:1/0#ns"), ("b", "redis://s:1/0#ns"), ("c", None), ("d", "redis://t:1/0#ns")):
        index.join(member, BS, store)
    index.apply("a", [stored([7, 8], None, tokens[:8], medium="STORAGE"), stored([9], 8, tokens[8:], medium="STORAGE"),
                      stored([1], None, tokens[:4])])
    assert {m: held(index, tokens, BS, m) for m in "abcd"} == {"a": 1 + 2 * 0.75, "b": 3 * 0.75, "c": 0, "d": 0}
    assert index.held_blocks()["store:redis://s:1/0#ns"] == 3
    index.apply("b", [stored([5], None, tokens[:4])])  # b's own device copy of block 0 counts whole
    assert held(index, tokens, BS, "b") == 1 + 2 * 0.75
    index.apply("a", [AllBlocksCleared()])
    assert held(index, tokens, BS, "a") == 3 * 0.75
    index.drop("a")
    assert held(index, tokens, BS, "b") == 1 + 2 * 0.75
    index.apply("c", [stored([4], None, tokens[:4], medium="STORAGE")])  # no store announced: a tier of c's own
    assert held(index, tokens, BS, "c") == 0.75
    index.drop("b")
    assert "store:redis://s:1/0#ns" not in index.held_blocks() and index.size() == 1


def test_memory_is_bounded_by_an_lru_and_speculative_credits_expire():
    index = PrefixIndex(capacity=6, speculative_ttl_s=0.2)
    for n in range(4):
        index.apply("a", [stored([10 * n + 1, 10 * n + 2], None, [n] * 8)])
    assert index.size() == 6 and index.stats.evicted == 2
    assert held(index, [0] * 8, BS, "a") == 0 and held(index, [3] * 8, BS, "a") == 2
    tokens = list(range(50, 62))
    index.credit("b", content_keys(tokens, BS), BS)  # not publishing: never credited
    index.join("a")
    index.credit("a", content_keys(tokens, BS), BS)
    assert held(index, tokens, BS, "a") == 3 and held(index, tokens, BS, "b") == 0
    time.sleep(0.25)
    index.sweep()
    assert held(index, tokens, BS, "a") == 0


def test_a_credit_never_outlives_the_eviction_of_a_block_the_instance_already_held():
    """The engine publishes nothing for a block it reuses, so a credit for one would never be confirmed: only
    the blocks the instance must compute are credited, and a held block's removal is seen at once."""
    index = PrefixIndex()
    tokens = list(range(70, 82))  # 3 blocks of 4
    index.apply("a", [stored([1, 2], None, tokens[:8])])
    index.credit("a", content_keys(tokens, BS), BS)  # routed there: the third block is to be computed
    assert held(index, tokens, BS, "a") == 3
    index.apply("a", [BlockRemoved(block_hashes=[1, 2], medium="GPU")])  # evicted before the request ran
    assert held(index, tokens, BS, "a") == 0
    index.apply("a", [stored([1, 2], None, tokens[:8])])  # computed again; the third still to come
    assert held(index, tokens, BS, "a") == 3
    index.apply("a", [stored([3], 2, tokens[8:])])
    assert held(index, tokens, BS, "a") == 3


# -- the listener against the real publisher ---------------------------------------------------------------
@pytest.fixture
def ipc(tmp_path):
    def config(name: str, **extra) -> KVEventsConfig:
        return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/{name}.pub",
                              replay_endpoint=f"ipc://{tmp_path}/{name}.replay", topic=f"kv@{name}", **extra)
    return config


@pytest.fixture
def listening():
    made = []

    def make(**kwargs) -> tuple[PrefixIndex, Listener]:
        index = PrefixIndex()
        listener = Listener(index, **kwargs)
        listener.start()
        made.append(listener)
        return index, listener

    yield make
    for listener in made:
        listener.stop()


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
        listener._stopping.set()  # the subscriber stalls: nothing reads its socket while thousands are sent
        listener._thread.join(5)
        publish_blocks(publisher, 0, 3000)
        wait_for(lambda: publisher.batches == 3000, timeout=60, what="the publisher to send")
        listener._stopping.clear()
        listener.start()
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


def test_kv_aware_weighs_cached_tokens_against_load_and_credits_its_choice():
    from pdserve.gateway.registry import Instance
    from pdserve.kv_events.policy import KvAware
    from pdserve.kv_events.prompt import RoutedPrompt

    def instance(url: str) -> Instance:
        made = Instance(url=url, role="both", pool=None, probe_pool=None)
        made.breaker.probe_result(ok=True, slow=False)
        return made

    index = PrefixIndex()
    a, b, c = instance("http://a:1"), instance("http://b:1"), instance("http://c:1")
    tokens = list(range(200, 265))  # 64 tokens hit at most (the last is computed): 16 blocks of 4
    index.join(b.url, BS)  # publishing, nothing cached yet: its block size is what it announced
    index.apply(a.url, [stored(list(range(1, 17)), None, tokens[:64])])
    prompt = RoutedPrompt(tokens)
    assert KvAware(index).pick([c, b, a], prompt=prompt) is a and prompt.cached == {a.url: 64.0}
    a.pending_tokens = 70  # more prefill queued there than recomputing the whole prompt elsewhere
    assert KvAware(index).pick([a, b, c], prompt=RoutedPrompt(tokens)) is not a
    a.pending_tokens, a.active_tokens = 0, 65 + 8  # streaming the answer to the prompt it computed: its KV is busy
    assert KvAware(index, overlap_weight=1).pick([a, c], prompt=RoutedPrompt(tokens)) is c  # 1 + 73 against 65
    assert KvAware(index).pick([a, c], prompt=RoutedPrompt(tokens)) is a  # the default 2: 2 + 73 against 130
    a.pending_tokens, a.active_tokens = 0, 1
    assert KvAware(index, overlap_weight=0).pick([a, b], prompt=RoutedPrompt(tokens)) is b  # load alone
    a.active_tokens = 0
    other = list(range(900, 965))
    chosen = KvAware(index).pick([b, c], prompt=RoutedPrompt(other))
    assert chosen is b or chosen is c
    # Only a publishing member is credited at once: a burst with one prefix finds it before its events come.
    assert held(index, other, BS, b.url) == (16 if chosen is b else 0)
    assert held(index, other, BS, c.url) == 0


def test_where_an_instance_publishes_comes_from_its_membership_record():
    """vLLM's own `--kv-events-config` endpoint (bound on every address) is dialled at the instance's host; a flag
    naming a publisher becomes the static record's `kv_events`; a record with no usable endpoint is scored by load."""
    from pdserve.gateway.registry import Instance
    from pdserve.gateway.service import GatewayConfig, _static_records
    from pdserve.kv_events.routing import publisher_of
    from pdserve.membership.record import KvEvents, MemberRecord, kv_events_from_vllm

    def at(url: str, kv_events: KvEvents | None) -> Instance:
        return Instance(url=url, role="both", pool=None, probe_pool=None, record=MemberRecord(url=url, role="both", kv_events=kv_events))

    vllm = kv_events_from_vllm('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                               '"replay_endpoint": "tcp://*:5558", "topic": "kv"}')
    assert publisher_of(at("http://10.0.0.5:8000", vllm)) == PublisherAddress(
        endpoint="tcp://10.0.0.5:5557", replay_endpoint="tcp://10.0.0.5:5558", topic="kv")
    assert publisher_of(at("http://10.0.0.5:8000", KvEvents(endpoint="http://not-zmq"))) is None
    assert publisher_of(at("http://10.0.0.5:8000", None)) is None  # nothing said, nothing learnt yet
    records = _static_records(GatewayConfig(both=["http://10.0.0.5:8000/", "http://10.0.0.6:8000"],
                                            kv_events=["http://10.0.0.5:8000=tcp://10.0.0.5:5557"]))
    assert [r.kv_events for r in records] == [KvEvents(endpoint="tcp://10.0.0.5:5557"), None]
    with pytest.raises(ValueError, match="no configured instance"):
        _static_records(GatewayConfig(both=["http://10.0.0.5:8000"], kv_events=["http://10.0.0.7:8000=tcp://h:1"]))
