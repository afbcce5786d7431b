"""kv_aware reads a chat prompt only as far as some instance could hold it (pdserve/kv_events/lazy_ids.py): the
ids read head by head are the tokenizer's own, a prompt that shares nothing with any cache is encoded no further than
its first unknown block, and what that saves never costs a burst with one new prefix its credit, nor leaves a credit
behind once the instance's events have spoken."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from pdserve.gateway.registry import Instance
from pdserve.kv_events.index import PrefixIndex
from pdserve.kv_events.fast_bpe import fast_encoder
from pdserve.kv_events.lazy_ids import cuts_agree
from pdserve.kv_events.pieces import PieceEncoder, corpus
from pdserve.kv_events.policy import KvAware
from pdserve.kv_events.prompt import PromptTokenizer
from pdserve.kv_events.wire import BlockRemoved, BlockStored

BS = 16
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike oscar papa Ünï 東京 it's".split()
PIECES = st.lists(st.sampled_from([*WORDS, " ", "  ", "\n", "42", ", ", "<|im_start|>", "<|im_end|>", "😀"]),
                  max_size=60).map(" ".join)


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> PromptTokenizer:
    made = PromptTokenizer(llama_dir)
    assert made.pieces.lazy_ok
    return made


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS[:15]) for _ in range(n))


def chat(system: str, question: str) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def instance(url: str) -> Instance:
    made = Instance(url=url, role="both", pool=None, probe_pool=None)
    made.breaker.probe_result(ok=True, slow=False)
    return made


def publish(index: PrefixIndex, member: str, ids: list[int], first_hash: int) -> list[int]:
    """`member`'s engine stored the prompt's whole blocks (but the last token's), as its events would say."""
    count = (len(ids) - 1) // BS
    hashes = list(range(first_hash, first_hash + count))
    index.apply(member, [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=ids[:count * BS],
                                     block_size=BS, lora_id=None, medium="GPU", lora_name=None)])
    return hashes


def pieces_of(folder: Path) -> PieceEncoder:
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return PieceEncoder(tokenizer, ordinary=fast_encoder(tokenizer))


@pytest.mark.parametrize("kind", ["llama_dir", "qwen_dir"])
def test_ids_read_head_by_head_are_the_ids_of_the_whole(kind: str, request: pytest.FixtureRequest) -> None:
    pieces = pieces_of(request.getfixturevalue(kind))
    assert pieces.lazy_ok

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(PIECES, st.lists(st.integers(0, 120), max_size=4))
    def same(text: str, asks: list[int]) -> None:
        whole = pieces.tokenizer.encode(text, add_special_tokens=False).ids
        lazy = pieces.lazy(text)
        for count in asks:
            lazy.ensure(count)
            assert lazy.ids == whole[:len(lazy.ids)] and (len(lazy.ids) >= count or lazy.complete)
        assert lazy.finish() == whole and lazy.estimate() == len(whole)
        assert pieces.encode(text) == whole  # and what it remembered of the pieces it finished is right

    same()


def test_a_sentencepiece_vocabulary_is_read_whole(tmp_path: Path) -> None:
    """Sentencepiece adds a space before each text it encodes: a head's ids and the rest's are not the whole's."""
    pytest.importorskip("sentencepiece")
    pytest.importorskip("mistral_common")
    from pdserve.modelgen.real_tokenizers import make_real_tokenizer_model

    pieces = pieces_of(make_real_tokenizer_model("mistral", tmp_path / "m"))
    assert pieces.enabled and not pieces.lazy_ok and pieces.lazy("any text") is None


def test_an_encoder_that_does_not_split_at_spaces_is_read_whole(tokenizer: PromptTokenizer) -> None:
    ordinary = tokenizer.pieces.ordinary
    assert cuts_agree(ordinary, corpus())
    assert not cuts_agree(lambda text: [1, *ordinary(text)], corpus())  # a prefix per call (sentencepiece's space, a BOS)


def test_a_prompt_that_shares_nothing_is_encoded_no_further_than_its_first_unknown_block(
        tokenizer: PromptTokenizer) -> None:
    rng = random.Random(3)
    index, policy = PrefixIndex(), None
    a, b = instance("http://a:1"), instance("http://b:1")
    for member in (a, b):
        index.join(member.url, BS)
    policy = KvAware(index)
    template = "You answer briefly. " + sentence(rng, 30)  # every prompt's system part: held by both
    for n, member in enumerate((a, b)):
        known = tokenizer.prompt(chat(template, "warm up " + sentence(rng, 5)))
        publish(index, member.url, known.tokens, 1000 * (n + 1))
    body = chat(template, "Unique question. " + sentence(rng, 200))
    whole = tokenizer.tokenizer.encode(tokenizer.render_chat(body), add_special_tokens=False).ids
    prompt = tokenizer.prompt(body)
    chosen = policy.pick([a, b], prompt=prompt)
    assert not prompt.exact, "read to its end though its question's first block is held nowhere"
    held_template = prompt.cached[chosen.url]
    assert held_template >= 2 * BS  # the template's blocks, held by both, were read and scored
    assert abs(prompt.num_tokens - len(whole)) <= 0.15 * len(whole)  # the load figure, estimated from the head
    assert prompt.tokens == whole  # finished on demand, the tokenizer's ids


def test_a_burst_with_one_new_prefix_goes_where_its_first_request_went(tokenizer: PromptTokenizer) -> None:
    """Before the first request's events come, the next ones with its prefix find the deferred credit: the rest of
    the first prompt is encoded then, and they go to the same instance."""
    rng = random.Random(4)
    index = PrefixIndex()
    a, b = instance("http://a:1"), instance("http://b:1")
    for member in (a, b):
        index.join(member.url, BS)
    policy = KvAware(index)
    system = "A new system prompt. " + sentence(rng, 150)
    first = tokenizer.prompt(chat(system, "Question one?"))
    chosen = policy.pick([a, b], prompt=first)
    other = b if chosen is a else a
    assert not first.exact
    chosen.pending_tokens = 200  # busier than the other, by less than the shared prefix is worth
    second = tokenizer.prompt(chat(system, "Question two?"))
    assert policy.pick([a, b], prompt=second) is chosen
    assert first.exact  # its credit was given in full
    shared = len(tokenizer.prompt(chat(system, "")).tokens)
    assert second.cached[chosen.url] >= (shared - 2 * BS) and second.cached.get(other.url, 0.0) == 0.0


def test_a_deferred_credit_is_void_once_the_instance_has_published(tokenizer: PromptTokenizer) -> None:
    """The engine computed the first prompt's blocks and then evicted all but the first (an engine evicts a
    request's last blocks first): a later prompt with that prefix must find that one block there and no more (a
    credit given after the events would outlive the eviction it never sees)."""
    rng = random.Random(5)
    index = PrefixIndex()
    a = instance("http://a:1")
    index.join(a.url, BS)
    policy = KvAware(index)
    system = "Another system prompt. " + sentence(rng, 150)
    first = tokenizer.prompt(chat(system, "Question one?"))
    assert policy.pick([a], prompt=first) is a and not first.exact
    hashes = publish(index, a.url, tokenizer.prompt(chat(system, "Question one?")).tokens, 1)
    index.apply(a.url, [BlockRemoved(block_hashes=hashes[1:], medium="GPU")])
    second = tokenizer.prompt(chat(system, "Question two?"))
    policy.pick([a], prompt=second)
    assert second.cached[a.url] == BS and not first.exact


def test_a_prompt_held_past_its_first_head_is_read_and_credited_whole(tokenizer: PromptTokenizer) -> None:
    """An instance holds a conversation this gateway never encoded (another gateway sent it): its next turn is
    read whole, every block scored, and the new ones credited at once."""
    rng = random.Random(6)
    index = PrefixIndex()
    a, b = instance("http://a:1"), instance("http://b:1")
    for member in (a, b):
        index.join(member.url, BS)
    earlier = chat("Held system prompt. " + sentence(rng, 150), "Earlier question, " + sentence(rng, 40))
    text = tokenizer.render_chat(earlier)
    publish(index, a.url, tokenizer.tokenizer.encode(text, add_special_tokens=False).ids, 1)  # not via the pieces
    body = {"messages": [*earlier["messages"], {"role": "assistant", "content": sentence(rng, 10)},
                         {"role": "user", "content": "And then? " + sentence(rng, 20)}]}
    prompt = tokenizer.prompt(body)
    assert KvAware(index).pick([b, a], prompt=prompt) is a
    assert prompt.exact  # read whole, as before there was any laziness
    keys = prompt.keys(BS)
    assert prompt.cached[a.url] >= len(text) // 4  # the earlier turn's blocks, scored
    assert index.overlap_blocks(keys, BS, [a.url])[a.url] == len(keys)  # the new ones credited at once


@pytest.mark.parametrize("template", ["$A", "<|im_start|> $A", "<|im_start|> $A <|im_end|>"])
def test_a_text_prompt_is_read_lazily_between_the_special_tokens_its_tokenizer_adds(
        llama_dir: Path, tmp_path: Path, template: str) -> None:
    """A completion's text prompt: the post-processor's tokens (a BOS, an EOS) around the text's own, read head by
    head like a chat's; the ids equal the tokenizer's own encoding with special tokens."""
    from tokenizers import processors

    tokenizer = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(name, specials[name]) for name in ("<|im_start|>", "<|im_end|>")
                                         if name in template])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    routed = PromptTokenizer(tmp_path / "tokenizer.json")
    assert routed.framing is not None
    rng = random.Random(7)
    index = PrefixIndex()
    a = instance("http://a:1")
    index.join(a.url, BS)
    policy = KvAware(index)
    for n in range(40):
        text = f"Unique {n}. " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 120)))
        prompt = routed.prompt({"prompt": text})
        policy.pick([a], prompt=prompt)
        long = len(text) > 400
        assert not (long and prompt.exact), "a long new prompt read to its end"
        assert prompt.tokens == tokenizer.encode(text, add_special_tokens=True).ids
