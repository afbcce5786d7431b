"""KV events without a model: vLLM's encodings decoded by name, the dual-key prefix index and the kv_aware policy
(the listener's tests are in test_kv_listener.py)."""

from __future__ import annotations

import os
import time
import tracemalloc

import msgspec
import pytest

from pdserve.kv_events import index as index_module
from pdserve.kv_events import native
from pdserve.kv_events.config import PublisherAddress, parse_address, parse_config
from pdserve.kv_events.index import PrefixIndex, content_keys
from pdserve.kv_events.wire import (AllBlocksCleared, BlockRemoved, BlockStored, EventDecodeError, KVEventBatch,
                                   decode_batch, encode_batch)

BS = 4


@pytest.fixture(autouse=True, params=["c_core", "python_core"])
def index_core(request, monkeypatch):
    """Every test runs with each of the index's cores (tests/test_kv_index_native.py holds them to each other)."""
    if request.param == "python_core":
        monkeypatch.setattr(index_module, "_native_module", lambda: None)
    elif native.load() is None and os.environ.get("CI") != "true":
        pytest.skip("the C core is not built here")
    return request.param


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


class Recorder:
    """The two calls BlockEvents makes of its publisher; each step's batch as a subscriber decodes it off the wire."""

    def __init__(self) -> None:
        self.pending: list = []
        self.batches: list[list] = []

    def record(self, event) -> None:
        self.pending.append(event)

    def end_step(self) -> None:
        batch = KVEventBatch(time.time(), self.pending)
        self.batches.append(decode_batch(encode_batch(batch)).events)
        self.pending = []


def test_a_steps_consecutive_removals_go_out_as_one_event_in_order():
    from pdserve.kv_events.block_events import BlockEvents, published_hash

    root, digest = b"\0" * 16, lambda n: n.to_bytes(16, "big")
    recorder = Recorder()
    events = BlockEvents(recorder, BS, root)
    events.stored(root, digest(1), (1, 2, 3, 4))
    events.stored(digest(1), digest(2), (5, 6, 7, 8))
    for n in (7, 8, 9):
        events.removed(digest(n))
    events.stored(root, digest(3), (9, 9, 9, 9))
    events.removed(digest(1))
    events.end_step()
    events.removed(digest(2))
    events.end_step()
    first, second = recorder.batches
    assert [type(e).__name__ for e in first] == ["BlockStored", "BlockRemoved", "BlockStored", "BlockRemoved"]
    assert first[1].block_hashes == [published_hash(digest(n)) for n in (7, 8, 9)]
    assert first[3].block_hashes == [published_hash(digest(1))] and len(second) == 1
    index = PrefixIndex()  # one event of many hashes removes each, as one event per hash would
    for batch in (first, second):
        index.apply("a", batch)
    assert held(index, [1, 2, 3, 4, 5, 6, 7, 8], BS, "a") == 0 and held(index, [9] * 4, BS, "a") == 1
    assert index.held_blocks()["a"] == 1


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


# -- routing ---------------------------------------------------------------------------------------------
def test_a_member_that_flaps_does_not_grow_the_index():
    """A publisher that cannot be reached is dropped and joined again on every retry, for as long as it is down."""
    index = PrefixIndex()
    tracemalloc.start()
    try:
        for _ in range(200):  # whatever is allocated once, and the live set allocated anew
            index.join("flapping", BS)
            index.apply("flapping", [stored([1, 2], None, list(range(2 * BS)))])
            index.drop("flapping")
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(5000):
            index.join("flapping", BS)
            index.apply("flapping", [stored([1, 2], None, list(range(2 * BS)))])
            index.drop("flapping")
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 20_000, f"{grown} bytes for 5000 drops and joins"
    assert index.held_blocks() == {} and index.size() == 0


def test_memory_stays_bounded_while_blocks_churn_through_a_full_index():
    index, hashes = PrefixIndex(capacity=200), iter(range(1, 10**9))

    def churn(batches: int) -> None:
        for n in range(batches):
            tokens = [n % 97 + i for i in range(4 * BS)]  # new content every batch; its blocks evict the oldest
            index.apply(f"m{n % 3}", [stored([next(hashes) for _ in range(4)], None, tokens)])

    tracemalloc.start()  # it counts what was allocated since, so the live set is counted once it has turned over
    try:
        churn(2_000)
        before = tracemalloc.get_traced_memory()[0]
        churn(4_000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.size() == 200 and index.stats.evicted == 6_000 * 4 - 200
    assert grown < 20_000, f"{grown} bytes for 16,000 more blocks through an index of 200"


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
    # The index is brought up to the events received before it is read: what `catch_up` applies decides the pick.
    late = list(range(500, 565))
    caught_up = KvAware(index, catch_up=lambda: index.apply(c.url, [stored(list(range(40, 56)), None, late[:64])]))
    assert caught_up.pick([a, b, c], prompt=RoutedPrompt(late)) is c


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
