"""A store that dies under a running `pdserve serve` instance, and comes back.

What must hold: while clients keep sending requests (prompts the store held, and new ones), the store's server is
killed (SIGKILL: Redis, or Mooncake's master); every request still answers 200 with the answer of recompute (an
engine without the store), none waits on the dead store (the tier's calls run off the engine's thread and a failed
one leaves the store alone for `retry_after`), `pdserve:kv_store_up` falls to 0 and `pdserve:kv_store_errors`
counts the failures; once the server is back the instance writes to it again; and the instance ends with zero
blocks in use.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from conftest import random_prompt
from pdserve.launcher import start_instance
from server_utils import completion_body, metric_values, wait_for, wait_until_idle
from store_servers import store_server
from test_kv_store import BACKENDS, ENGINE, Engines, assert_recomputed_alike, generate


def answer(url: str, prompt: list[int]) -> tuple[list[int], list[float], int]:
    response = httpx.post(f"{url}/v1/completions", json=completion_body(prompt), timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_store_killed_mid_run_costs_recompute_only_and_comes_back(models, tmp_path, backend):
    model = models("llama")
    server = store_server(backend, tmp_path / backend, "64mb" if backend == "redis" else "64MB")
    config = {"kv_store": {"url": server.url, "retry_after": 0.5, "lookup_timeout": 0.5, "load_timeout": 2}}
    instance = None
    oracle = Engines(model)
    try:
        instance = start_instance(model, "--max-model-len", str(ENGINE["max_model_len"]), "--num-kv-blocks", "48",
                                  "--served-model-name", "tiny", "--kv-transfer-config", json.dumps(config))
        url = instance.url
        prompts = [random_prompt(100, 200 + i) for i in range(8)]
        expected = generate(oracle(), prompts)
        for prompt, want in zip(prompts[:4], expected[:4], strict=True):
            assert_recomputed_alike([answer(url, prompt)], [want])
        wait_for(lambda: metric_values(url)["pdserve:kv_store_blocks_written_total"] >= 24, what="the writes")

        answers: dict[int, tuple] = {}
        failures: list[BaseException] = []
        killed = threading.Event()

        def client() -> None:  # the 8 prompts twice over: 48 blocks of cache, so the first ones are evicted
            try:
                for i in list(range(8)) * 2:
                    answers[len(answers)] = (i, answer(url, prompts[i]))
                    if len(answers) == 2 and not killed.wait(60):  # the rest run with the store gone
                        raise TimeoutError("the store was never killed")
            except BaseException as exc:  # noqa: BLE001 - reported by the test below
                failures.append(exc)

        thread = threading.Thread(target=client)
        thread.start()
        wait_for(lambda: len(answers) >= 2 or not thread.is_alive(), what="the first answers")
        server.kill()
        killed.set()
        thread.join(120)
        assert not thread.is_alive() and not failures, failures
        for i, got in answers.values():
            assert_recomputed_alike([got], [expected[i]])
        values = metric_values(url)
        assert values["pdserve:kv_store_errors_total"] > 0 and values["pdserve:kv_store_up"] == 0

        server.start()  # the same ports; a restarted store is empty
        written = values["pdserve:kv_store_blocks_written_total"]
        fresh = random_prompt(100, 250)

        def writes_again() -> bool:
            answer(url, fresh + random_prompt(16, int(time.monotonic() * 1000) % 10000))
            now = metric_values(url)
            return now["pdserve:kv_store_up"] == 1 and now["pdserve:kv_store_blocks_written_total"] > written
        wait_for(writes_again, timeout=60, what="the instance to write to the restarted store")
        wait_until_idle(url, timeout=20)
    finally:
        if instance is not None:
            instance.stop()
        oracle.close()
        server.stop()


def test_a_store_that_accepts_but_never_answers_does_not_hold_up_a_write():
    """The engine's step calls `write`, which must only queue. A store whose TCP port accepts but never answers
    keeps the tier's connect waiting up to the client's timeout; meanwhile a write returns, with that connect
    still pending (no failure counted yet)."""
    import socket

    import torch

    from pdserve.kv_store.config import StoreConfig
    from pdserve.kv_store.factory import namespace_for
    from pdserve.kv_store.tier import KVStoreTier, StoredBlock

    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        namespace = namespace_for("m", torch.float32, 16, num_layers=1, kv_heads=1, head_dim=2)
        tier = KVStoreTier(StoreConfig(url=url), namespace)
        try:
            tier.connect_soon()
            silent.settimeout(30)
            held, _ = silent.accept()  # the tier's client is connected and waits for its PING's answer
            with held:
                block = StoredBlock("k", b"h", b"", tuple(range(16)))
                tier.write([block], torch.zeros(1, namespace.block_bytes, dtype=torch.uint8))
                assert tier.stats.errors == 0 and tier.stats.up, "the write waited for the store's connect"
        finally:
            tier.close()
