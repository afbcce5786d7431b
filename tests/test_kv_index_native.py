"""The prefix index's C core against its Python core: any sequence of events and index calls leaves both indexes
with the same holders, credits, entries, LRU order and counters, and gives the same answers to routing's queries
(hypothesis's stateful testing drives them); both key a prompt alike."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from xxhash import xxh3_64_intdigest

from pdserve.kv_events import index_queries, native
from pdserve.kv_events.index import PrefixIndex, content_keys
from pdserve.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored

MEMBERS = ("a", "b", "c")
CAPACITY = 12  # entries: small, so the LRU bound evicts often
MEDIA = (None, "GPU", "CPU", "STORAGE")
TOKENS = [[(7 * i + j) % 5 for j in range(64)] for i in range(2)]  # two prompts with few distinct blocks

pytestmark = pytest.mark.skipif(native.load() is None and os.environ.get("CI") != "true",
                                reason="the C core is not built here (python -m pdserve.kv_events.native)")


def test_ci_builds_the_c_core_and_the_index_uses_it():
    assert native.load() is not None, "make install builds the KV index's C core"
    assert PrefixIndex().native and not PrefixIndex(native_core=False).native


def engine_hash(n: int, kind: str) -> int | bytes:
    """One small engine hash space in three spellings: reused hashes, signed twins and digests all occur."""
    return {"u64": n, "signed": n - 2**64 if n % 2 else n, "digest": n.to_bytes(32, "big")}[kind]


def folded(ekey: int | bytes) -> int:
    return xxh3_64_intdigest(ekey) if isinstance(ekey, bytes) else ekey


class SameIndex(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.indexes = [PrefixIndex(capacity=CAPACITY, native_core=native) for native in (True, False)]

    def apply(self, member: str, events: list) -> None:
        for index in self.indexes:
            index.apply(member, events)

    @rule(member=st.sampled_from(MEMBERS), prompt=st.integers(0, 1), first=st.integers(0, 2), count=st.integers(1, 4),
          bs=st.sampled_from([4, 8]), medium=st.sampled_from(MEDIA), parent=st.one_of(st.none(), st.integers(0, 12)),
          base=st.integers(0, 12), kind=st.sampled_from(["u64", "signed", "digest"]),
          damage=st.sampled_from(["", "", "", "length", "overflow", "negative", "announce"]))
    def stored(self, member, prompt, first, count, bs, medium, parent, base, kind, damage):
        tokens = TOKENS[prompt][first * bs:(first + count) * bs]
        count = len(tokens) // bs
        tokens = {"length": tokens[:-1], "overflow": [*tokens[:-1], 2**32], "negative": [*tokens[:-1], -1],
                  "announce": []}.get(damage, tokens)
        hashes = [engine_hash(base + i, kind) for i in range(count)]
        self.apply(member, [BlockStored(block_hashes=hashes, parent_block_hash=None if parent is None else
                                        engine_hash(parent, kind), token_ids=tokens, block_size=bs, lora_id=None,
                                        medium=medium, lora_name=None)])

    @rule(member=st.sampled_from(MEMBERS), hashes=st.lists(st.integers(0, 16), max_size=6),
          medium=st.sampled_from(MEDIA), kind=st.sampled_from(["u64", "signed", "digest"]), each=st.booleans())
    def removed(self, member, hashes, medium, kind, each):
        hashes = [engine_hash(h, kind) for h in hashes]
        events = [BlockRemoved(block_hashes=[h], medium=medium) for h in hashes] if each else \
            [BlockRemoved(block_hashes=hashes, medium=medium)]
        self.apply(member, events)

    @rule(member=st.sampled_from(MEMBERS))
    def cleared(self, member):
        self.apply(member, [AllBlocksCleared()])

    @rule(member=st.sampled_from(MEMBERS), how=st.sampled_from(["clear", "drop"]))
    def forget(self, member, how):
        for index in self.indexes:
            getattr(index, how)(member)

    @rule(member=st.sampled_from(MEMBERS), store=st.sampled_from([None, "s"]), bs=st.sampled_from([None, 4]))
    def join(self, member, store, bs):
        for index in self.indexes:
            index.join(member, bs, store)

    @rule(member=st.sampled_from(MEMBERS), prompt=st.integers(0, 1), bs=st.sampled_from([4, 8]))
    def credit(self, member, prompt, bs):
        for index in self.indexes:
            index.credit(member, content_keys(TOKENS[prompt], bs, limit=6), bs)

    @rule(member=st.sampled_from(MEMBERS), bs=st.sampled_from([4, 8]), count=st.integers(1, 3))
    def a_store_holds_a_prefix(self, member, bs, count):
        """The member reads a store that holds the first blocks of a prompt (common in use, rare by chance above)."""
        for index in self.indexes:
            index.join(member, None, "s")
        self.apply(member, [BlockStored(block_hashes=[100 + i for i in range(count)], parent_block_hash=None,
                                        token_ids=TOKENS[0][:count * bs], block_size=bs, lora_id=None,
                                        medium="STORAGE", lora_name=None)])

    @rule()
    def credits_lapse(self):
        """Every credit given so far runs out, as its time to live would."""
        for index in self.indexes:
            for by_key in index._speculative.values():
                for by_member in by_key.values():
                    by_member.update(dict.fromkeys(by_member, 0.0))

    @invariant()
    def the_same(self):
        c, py = self.indexes
        assert c._holders == py._holders
        credits = [{bs: {k: set(m) for k, m in by.items()} for bs, by in i._speculative.items()} for i in (c, py)]
        assert credits[0] == credits[1]
        assert c.held_blocks() == py.held_blocks() and c.size() == py.size() <= CAPACITY
        assert c.stats == py.stats
        assert c.lru_items() == [(m, folded(e)) for m, e in py.lru_items()]
        assert {m: c.block_size(m) for m in MEMBERS} == {m: py.block_size(m) for m in MEMBERS}
        assert {m: set(s.speculative) for m, s in c._members.items()} == \
            {m: set(s.speculative) for m, s in py._members.items()}
        members = [*MEMBERS, "store:s", "unknown"]
        for bs in (4, 8):
            for tokens in TOKENS:
                keys = content_keys(tokens, bs)
                assert c.overlap_blocks(keys, bs, members) == py.overlap_blocks(keys, bs, members)
                for start in (0, 2, 9):
                    assert c.known_run(keys, start, bs) == py.known_run(keys, start, bs)
                assert [c.guessed(m, keys[1], bs) for m in MEMBERS] == [py.guessed(m, keys[1], bs) for m in MEMBERS]


SameIndex.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
test_the_c_core_and_the_python_core_agree = SameIndex.TestCase


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=70), bs=st.integers(1, 9), start=st.integers(0, 30),
       count=st.integers(-1, 9), seed=st.integers(0, 2**64 - 1))
def test_the_c_core_keys_a_prompt_as_the_python_index_does(tokens, bs, start, count, seed):
    keys = native.load().content_keys(tokens, start, bs, count, seed)
    assert keys == index_queries.content_keys(tokens, start, bs, count, seed)
    assert keys == content_keys(tokens[start:], bs, None if count < 0 else count, seed)


@pytest.mark.parametrize("bad", [[1, 2, 2**32], [1, -1, 3], [1, "2", 3]])
def test_a_token_id_that_is_no_uint32_raises_in_both_keyings(bad):
    with pytest.raises((OverflowError, TypeError)) as from_c:
        native.load().content_keys(bad, 0, 3, -1, 1)
    with pytest.raises((OverflowError, TypeError)) as from_python:
        index_queries.content_keys(bad, 0, 3, -1, 1)
    assert from_c.type is from_python.type


def test_a_batch_the_c_core_cannot_read_raises_and_leaves_the_index_usable():
    index = PrefixIndex(native_core=True)
    bad = BlockStored(block_hashes=[1.5], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4, lora_id=None,
                      medium="GPU", lora_name=None)  # a float hash: no decoder makes one, the core refuses it
    with pytest.raises(TypeError):
        index.apply("a", [bad])
    index.apply("a", [BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4,
                                  lora_id=None, medium="GPU", lora_name=None)])
    assert index.held_blocks() == {"a": 1}
    assert index.overlap_blocks(content_keys([1, 2, 3, 4], 4), 4, ["a"]) == {"a": 1.0}
