"""pdserve's PdConnector inside vLLM over the nixl data plane: each vLLM layer tensor registered with NIXL once,
D reading P's blocks per (block, layer) after P's grant.

What must hold: with `"data_plane": "nixl"` on both vLLM instances (the only plane either then serves), pull
through the gateway equals the same vLLM colocated, D really loaded the prompt's KV (vLLM counts its tokens as
external: a failed load would have been recomputed), and afterwards both caches are idle again.

Two vLLM instances for the module (P also serves as the colocated oracle).
"""

from __future__ import annotations

import pytest

from conftest import random_prompt
from server_utils import assert_same_answer, data_planes, wait_for
from test_vllm_pd_connector import complete, external_tokens
from vllm_live import pd_connector_pull, usage

pytestmark = [pytest.mark.vllm, pytest.mark.parametrize("plane", data_planes("nixl"))]

PROMPTS = [random_prompt(20, 61), random_prompt(300, 62)]


@pytest.fixture(scope="module")
def pair(models):
    nixl = {"data_plane": "nixl"}
    with pd_connector_pull(models("llama"), nixl, nixl) as (p, d, gateway):
        yield {"P": p.url, "D": d.url, "gateway": gateway.url}


@pytest.mark.parametrize("prompt", PROMPTS, ids=["one-vllm-block", "three-vllm-blocks"])
def test_pull_over_nixl_between_two_vllm_instances_equals_colocated(pair, prompt, plane):
    expected = complete(pair["P"], prompt).json()
    before = external_tokens(pair["D"])
    response = complete(pair["gateway"], prompt)
    assert response.status_code == 200, response.text
    assert_same_answer(response.json(), expected)
    assert external_tokens(pair["D"]) - before >= len(prompt) - 1  # loaded over nixl, not computed on D
    wait_for(lambda: usage(pair["D"]) == 0.0, timeout=20, what="vLLM D's KV cache to be idle")
    wait_for(lambda: usage(pair["P"]) == 0.0, timeout=20, what="vLLM P's KV cache to be idle")
