"""pdserve's PdConnector inside vLLM over the nixl data plane: each vLLM layer tensor registered with NIXL once,
D reading P's blocks per (block, layer) after P's grant (pull), P writing each layer into D's (push).

What must hold: with `"data_plane": "nixl"` on both vLLM instances (the only plane either then serves), pull and
push through the gateway equal the same vLLM colocated, D really received the prompt's KV (vLLM counts its tokens
as external: a failed transfer would have been recomputed), and afterwards both caches are idle again.

Two vLLM instances for the module (P also serves as the colocated oracle).
"""

from __future__ import annotations

import pytest

from conftest import random_prompt
from pdserve.launcher import start
from server_utils import assert_same_answer, data_planes, wait_for
from test_vllm_pd_connector import complete, external_tokens
from vllm_live import pd_connector_pull, usage

pytestmark = [pytest.mark.vllm, pytest.mark.parametrize("plane", data_planes("nixl"))]

# Inside one vLLM block (128 tokens on CPU) and spanning three.
LENGTHS = {"one-vllm-block": 20, "three-vllm-blocks": 300}


@pytest.fixture(scope="module")
def pair(models):
    nixl = {"data_plane": "nixl"}
    with pd_connector_pull(models("llama"), nixl, nixl) as (p, d, gateway):
        push = start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--prefill", p.url,
                                 "--decode", d.url, "--protocol", "push"])
        try:
            yield {"P": p.url, "D": d.url, "pull": gateway.url, "push": push.url}
        finally:
            push.stop()


@pytest.mark.parametrize("protocol", ["pull", "push"])
@pytest.mark.parametrize("size", LENGTHS)
def test_transfer_over_nixl_between_two_vllm_instances_equals_colocated(pair, size, protocol, plane):
    # Each case its own prompt: D's prefix cache would otherwise hold what an earlier case moved.
    prompt = random_prompt(LENGTHS[size], 61 + LENGTHS[size] + (protocol == "push"))
    expected = complete(pair["P"], prompt).json()
    before = external_tokens(pair["D"])
    response = complete(pair[protocol], prompt)
    assert response.status_code == 200, response.text
    assert_same_answer(response.json(), expected)
    assert external_tokens(pair["D"]) - before >= len(prompt) - 1  # moved over nixl, not computed on D
    wait_for(lambda: usage(pair["D"]) == 0.0, timeout=20, what="vLLM D's KV cache to be idle")
    wait_for(lambda: usage(pair["P"]) == 0.0, timeout=20, what="vLLM P's KV cache to be idle")
