"""The shared KV store tier on real stores (redis-server, Mooncake's master and a segment-holding client), with
pdserve engines in this process sharing them as separate instances would.

What must hold: a prefix one engine computed is loaded by another from the store (its full blocks past the local
prefix-cache hit, the output's blocks included, for the next turn of a conversation), and only the rest is
prefilled; every answer equals recompute (an engine without the store: tokens equal, logprobs within the
cross-process bound); a stored value that is damaged, cut short, another prompt's, another model's or layout's,
expired between lookup and read, or evicted from a full store is never used: the blocks before it are, the rest
is computed; and every engine ends with zero KV blocks in use.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import assert_no_blocks_in_use, random_prompt
from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_store.codec import PREAMBLE
from pdserve.kv_transfer.factory import ConnectorBundle, build_connectors
from pdserve.sampling_params import SamplingParams
from server_utils import CROSS_PROCESS_LOGPROB_TOL, wait_for
from store_servers import StoreServer, store_server

BS = 16
# Mooncake is one of conftest's breadth-only names: its cases here are the suite's `core`, so they always run.
BACKENDS = ["redis", pytest.param("mooncake", marks=pytest.mark.core)]
ENGINE = {"num_kv_blocks": 96, "max_model_len": 512, "seed": 0}


class Engines:
    """Engines of one model, with or without a store; each checked for blocks in use and closed at teardown."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.made: list[tuple[LLMEngine, ConnectorBundle | None]] = []

    def __call__(self, store: str | None = None, **store_extra) -> LLMEngine:
        kw = {**ENGINE, **store_extra.pop("engine", {})}
        kv = {"kv_store": {"url": store, "retry_after": 0.5, **store_extra}} if store else {}
        config = EngineConfig(model=self.model, kv_transfer_config=kv, **kw)
        spec = config.resolve_model()
        bundle = build_connectors(config, spec)
        engine = LLMEngine(config, bundle, spec)
        self.made.append((engine, bundle))
        return engine

    def close(self) -> None:
        for engine, bundle in self.made:
            assert_no_blocks_in_use(engine)
            if bundle is not None:
                bundle.agent.stop()
                if bundle.store is not None:
                    bundle.store.close()


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> Iterator[dict[str, StoreServer]]:
    root = tmp_path_factory.mktemp("stores")
    started: dict[str, StoreServer] = {}
    try:
        started["redis"] = store_server("redis", root / "redis", "64mb")
        started["mooncake"] = store_server("mooncake", root / "mooncake", "64MB")
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture
def engines(models) -> Iterator[Engines]:
    made = Engines(models("llama"))
    yield made
    made.close()


@pytest.fixture(scope="module")
def oracle(models) -> Iterator[LLMEngine]:
    """Recompute: an engine with no store and no prefix cache."""
    config = EngineConfig(model=models("llama"), enable_prefix_caching=False, **ENGINE)
    engine = LLMEngine(config)
    yield engine
    assert_no_blocks_in_use(engine)


def add(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 6) -> list:
    return [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                           logprobs=1)) for i, p in enumerate(prompts)]


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 6) -> list[tuple[list[int], list[float], int]]:
    """Greedy (tokens, logprobs, cached prompt tokens) per prompt."""
    return drain(engine, add(engine, prompts, max_tokens))


def drain(engine: LLMEngine, ids: list) -> list[tuple[list[int], list[float], int]]:
    """Step until the requests finished and the store's loads ended too."""
    got: dict = {rid: ([], [], 0) for rid in ids}
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests() or engine.has_work():
        assert time.monotonic() < deadline, "the engine did not finish"
        for out in engine.step():
            tokens, logprobs, _ = got[out.request_id]
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.new_logprobs]
            if out.finished:
                got[out.request_id] = (tokens, logprobs, out.num_cached_tokens)
    return [got[rid] for rid in ids]


def assert_recomputed_alike(got, expected) -> None:
    for (tokens, logprobs, _), (want, want_lp, _) in zip(got, expected, strict=True):
        assert tokens == want
        assert max(abs(a - b) for a, b in zip(logprobs, want_lp, strict=True)) <= CROSS_PROCESS_LOGPROB_TOL


def store_of(engine: LLMEngine):
    return engine.runner.connector.store.tier


def flushed(engine: LLMEngine) -> LLMEngine:
    """Every write the engine queued has reached the store."""
    assert store_of(engine).flush(30)
    return engine


def keys_of(engine: LLMEngine, prompt: list[int]) -> list[str]:
    """The store keys of the prompt's full blocks, as `engine` names them."""
    from pdserve.kv_store.keys import BlockChain

    chain = BlockChain(store_of(engine).namespace)
    chain.extend(len(prompt) // BS, lambda a, b: prompt[a:b])
    return [chain.key(i) for i in range(len(chain.hashes))]


def raw_client(engine: LLMEngine):
    """The engine's own connection to its store, for a test to read or damage values directly."""
    tier = store_of(engine)
    tier._call(lambda backend: None)  # connected
    return tier.backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_instance_loads_what_another_stored_and_answers_as_recompute(engines, stores, oracle, backend, attempt):
    url = stores[backend].url
    writer, reader = engines(url), engines(url)
    prompt = random_prompt(100, 1 + len(backend) + 1000 * attempt)  # six full blocks and 4 tokens
    first = generate(writer, [prompt])
    flushed(writer)
    assert store_of(writer).stats.blocks_written >= 6
    got = generate(reader, [prompt])
    assert_recomputed_alike(got, generate(oracle, [prompt]))
    assert_recomputed_alike(first, got)
    stats = store_of(reader).stats
    assert (stats.hit_blocks, stats.bytes_read) == (6, 6 * store_of(reader).namespace.block_bytes)
    assert got[0][2] == 96  # reported as cached: loaded, not computed
    assert reader.stats().prompt_tokens_computed == 4


def test_the_local_cache_first_then_the_store_then_the_rest(engines, stores, oracle, attempt):
    url = stores["redis"].url
    writer, reader = engines(url), engines(url)
    prompt = random_prompt(150, 11 + 1000 * attempt)  # nine full blocks and 6 tokens
    generate(writer, [prompt])
    flushed(writer)
    generate(reader, [prompt[:50]])  # three of its blocks in the reader's own cache
    before = store_of(reader).stats.hit_blocks
    tail = random_prompt(20, 12 + 1000 * attempt)  # and a tail nobody computed
    got = generate(reader, [prompt + tail])
    assert_recomputed_alike(got, generate(oracle, [prompt + tail]))
    assert store_of(reader).stats.hit_blocks - before == 6  # blocks 3..8: after the local hit, before the tail


def test_a_conversation_next_turn_loads_the_answer_blocks_too(engines, stores, oracle, attempt):
    url = stores["redis"].url
    writer, reader = engines(url), engines(url)
    question = random_prompt(40, 21 + 1000 * attempt)
    (answer, _, _), = generate(writer, [question], max_tokens=40)
    flushed(writer)
    turn = question + answer + random_prompt(10, 22 + 1000 * attempt)  # the history, with the answer as generated
    got = generate(reader, [turn])
    assert_recomputed_alike(got, generate(oracle, [turn]))
    # 79 computed tokens (the last sampled token has no KV yet): four full blocks, two of them the answer's.
    assert store_of(reader).stats.hit_blocks == 4


def damage(value: bytes, how: str, other: bytes) -> bytes:
    if how == "corrupt":  # one KV byte flipped
        return value[:-5] + bytes([value[-5] ^ 0xFF]) + value[-4:]
    if how == "truncate":
        return value[:len(value) // 2]
    return other  # another prompt's block, stored under this prompt's key


@pytest.mark.parametrize("how,reason", [("corrupt", "checksum"), ("truncate", "truncated"), ("swap", "tokens")])
def test_a_bad_value_is_refused_the_blocks_before_it_used_and_the_rest_recomputed(engines, stores, oracle, how,
                                                                                  reason, attempt):
    url = stores["redis"].url
    writer, reader = engines(url), engines(url)
    seed = len(how) + 1000 * attempt
    prompt, other = random_prompt(100, 30 + seed), random_prompt(100, 40 + seed)
    generate(writer, [prompt, other])
    flushed(writer)
    keys, backend = keys_of(reader, prompt), raw_client(reader)
    bad = keys[3]
    (value,), (other_value,) = backend.get([bad]), backend.get([keys_of(reader, other)[3]])
    assert backend.put([(bad, damage(value, how, other_value))], None) == [True]
    got = generate(reader, [prompt])
    assert_recomputed_alike(got, generate(oracle, [prompt]))
    stats = store_of(reader).stats
    assert (stats.hit_blocks, stats.refused[reason]) == (3, 1)
    assert got[0][2] == 48
    # The bad value was removed and the recomputed block written in its place.
    flushed(reader)
    wait_for(lambda: (backend.get([bad])[0] or b"")[PREAMBLE:] != damage(value, how, other_value)[PREAMBLE:]
             and backend.exists([bad]) == [True], timeout=10, what="the recomputed block to be stored")


def test_an_entry_expired_between_lookup_and_read_is_recomputed(engines, stores, oracle, attempt):
    """Redis expires the entry itself after the reader's lookup found it: the load finds it gone."""
    url = stores["redis"].url
    writer, reader = engines(url), engines(url)
    prompt = random_prompt(100, 50 + 1000 * attempt)
    generate(writer, [prompt])
    flushed(writer)
    (rid,) = add(reader, [prompt])
    tracked = reader.scheduler.connector.store._tracked[rid]
    wait_for(lambda: tracked.lookup is not None and tracked.lookup.done(), what="the reader's lookup")
    assert tracked.lookup.result() == [True] * 6
    backend = raw_client(reader)
    backend._client.pexpire(keys_of(reader, prompt)[2], 1)
    wait_for(lambda: backend.exists([keys_of(reader, prompt)[2]]) == [False], what="Redis to expire the entry")
    got = drain(reader, [rid])
    assert_recomputed_alike(got, generate(oracle, [prompt]))
    stats = store_of(reader).stats
    assert stats.refused["missing"] == 1 and stats.hit_blocks == 2


def test_an_entry_past_the_readers_ttl_is_recomputed_on_mooncake(engines, stores, oracle, attempt):
    """Mooncake objects do not expire; the tier's TTL is the stored header's, checked when the value is read."""
    url = stores["mooncake"].url
    writer, reader = engines(url), engines(url, ttl=0.2)
    prompt = random_prompt(100, 55 + 1000 * attempt)
    generate(writer, [prompt])
    flushed(writer)
    time.sleep(0.3)
    got = generate(reader, [prompt])
    assert_recomputed_alike(got, generate(oracle, [prompt]))
    stats = store_of(reader).stats
    assert (stats.hit_blocks, stats.refused["expired"]) == (0, 1)


def test_another_model_or_layouts_blocks_are_never_used(engines, stores, oracle, attempt):
    url = stores["redis"].url
    prompt = random_prompt(100, 60 + 1000 * attempt)
    other_dtype, other_size = engines(url, engine={"dtype": "bfloat16"}), engines(url, engine={"block_size": 32})
    generate(other_dtype, [prompt])
    generate(other_size, [prompt])
    flushed(other_dtype)
    flushed(other_size)
    reader = engines(url)
    # Their keys are not this engine's: nothing is found.
    assert raw_client(reader).exists(keys_of(reader, prompt)) == [False] * 6
    # And their bytes under this engine's key (a namespace collision, or a misconfigured writer) are refused.
    backend = raw_client(reader)
    foreign = backend.get([keys_of(other_dtype, prompt)[0]])[0]
    assert backend.put([(keys_of(reader, prompt)[0], foreign)], None) == [True]
    got = generate(reader, [prompt])
    assert_recomputed_alike(got, generate(oracle, [prompt]))
    assert (store_of(reader).stats.hit_blocks, store_of(reader).stats.refused["namespace"]) == (0, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_store_evicts_or_refuses_and_answers_stay_right(engines, oracle, tmp_path, backend, attempt):
    """A store filled past its size before the writer runs: Redis evicts its least recently used values, Mooncake
    refuses writes until its master evicts; either way the store did not fail, and every answer equals recompute."""
    server = store_server(backend, tmp_path / backend, "4mb" if backend == "redis" else "32MB")
    try:
        writer, reader = engines(server.url), engines(server.url)
        fillers = [f"filler-{i}" for i in range(32 if backend == "redis" else 40)]
        backend_client = raw_client(writer)
        for key in fillers:
            backend_client.put([(key, bytes(256 << 10 if backend == "redis" else 1 << 20))], None)
        prompts = [random_prompt(100, 70 + i + 1000 * attempt) for i in range(4)]
        generate(writer, prompts, max_tokens=1)
        flushed(writer)
        got = generate(reader, prompts)
        assert_recomputed_alike(got, generate(oracle, prompts))
        assert store_of(writer).stats.errors == store_of(reader).stats.errors == 0
        if backend == "redis":
            assert raw_client(reader)._client.info("stats")["evicted_keys"] > 0
        else:
            assert store_of(writer).stats.write_refused > 0 or not all(backend_client.exists(fillers))
    finally:
        server.stop()


def test_unknown_store_settings_are_refused_at_startup(models):
    for bad, says in (({"url": "redis://127.0.0.1:1/0", "ttll": 3}, "unknown kv_store keys ['ttll']"),
                      ({"url": "memcached://127.0.0.1:1"}, "kv_store.url must be"),
                      ({"url": "redis://127.0.0.1:1/0", "capacity": "1GiB"}, "applies to mooncake"),
                      ({"url": "mooncake://127.0.0.1:1", "capacity": "lots"}, "must be a byte count")):
        config = EngineConfig(model=models("llama"), kv_transfer_config={"kv_store": bad}, **ENGINE)
        with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
            build_connectors(config, config.resolve_model())


def test_block_keys_bind_model_dtype_block_size_and_salt():
    from pdserve.kv_store.factory import namespace_for
    from pdserve.kv_store.keys import BlockChain

    base = dict(model="m", dtype=torch.float32, block_size=16, num_layers=2, kv_heads=2, head_dim=8)
    tokens = list(range(64))

    def keys(salt: str = "", **change) -> list[str]:
        chain = BlockChain(namespace_for(**{**base, **change}), salt)
        chain.extend(4, lambda a, b: tokens[a:b])
        return [chain.key(i) for i in range(4)]

    mine = keys()
    assert mine == keys()  # stable across processes and instances
    for other in (keys(model="n"), keys(dtype=torch.bfloat16), keys(block_size=32), keys(num_layers=3),
                  keys(salt="tenant")):
        assert not set(other) & set(mine)


def test_an_instance_connects_to_its_store_before_its_first_request(engines, stores):
    """A restarted instance's first requests must not wait for the store client's setup: the connection is made
    as the engine is built. Redis lists its clients: a new one appears with no request sent yet."""
    import redis

    admin = redis.Redis.from_url(stores["redis"].url)
    try:
        before = {c["id"] for c in admin.client_list()}  # this test's own and any earlier test's, closing or not
        engines(stores["redis"].url)
        wait_for(lambda: {c["id"] for c in admin.client_list()} - before, what="the engine's store connection")
    finally:
        admin.close()
