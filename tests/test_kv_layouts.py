"""Regrouping KV between pdserve's pool and vLLM-CPU's caches (`kv_transfer/layouts.py`), and refusing layouts
it does not know.

What must hold: a pdserve block read as bytes and regrouped into vLLM-CPU's caches holds, per token, head and
dimension, the same key and value (read through vLLM-CPU's key layout, dimension-major, independently of the
regrouping code), and the reverse brings vLLM's bytes back into pdserve blocks unchanged; a writer (push) stages
its blocks, or one layer of them, in the peer's layout with the same result; a layout that differs
in anything but the engine's own arrangement is refused, naming what differs.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer.layouts import Regrouper, pdserve_layout, translation_refused, vllm_cpu_layout

LAYERS, HEADS, BLOCK, DIM, BLOCKS = 3, 2, 32, 8, 6


def vllm_caches() -> list[torch.Tensor]:
    return [torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]


def layouts(**changes) -> tuple:
    pd = pdserve_layout(BLOCK, LAYERS, HEADS, DIM, torch.float32, "weights")
    return pd, vllm_cpu_layout(vllm_caches(), changes.get("block", BLOCK), changes.get("model", "weights"))


def vllm_key(cache: torch.Tensor, block: int, head: int, row: int) -> torch.Tensor:
    """vLLM-CPU keeps a block's keys per head dimension-major: element (dim, row) at dim * block_size + row."""
    flat = cache[block, head].reshape(-1)
    return flat[torch.arange(DIM) * BLOCK + row]


def vllm_value(cache: torch.Tensor, block: int, head: int, row: int) -> torch.Tensor:
    flat = cache[block, head].reshape(-1)
    return flat[BLOCK * DIM + row * DIM: BLOCK * DIM + (row + 1) * DIM]


def test_pdserve_blocks_regroup_into_vllm_cpu_caches_and_back():
    pd, vl = layouts()
    pool = torch.randn(BLOCKS, LAYERS, 2, HEADS, BLOCK, DIM)
    source, target = [4, 1], [2, 5]
    staging, _ = Regrouper(vl, pd).staging(2)
    staging.copy_(pool[source].view(2, LAYERS, -1).view(torch.uint8))  # the bytes a socket read brings
    caches = vllm_caches()
    Regrouper(vl, pd).regroup(staging, caches, target)
    for src, dst in zip(source, target):
        for layer in range(LAYERS):
            for head in range(HEADS):
                for row in (0, 7, BLOCK - 1):
                    assert torch.equal(vllm_key(caches[layer], dst, head, row), pool[src, layer, 0, head, row])
                    assert torch.equal(vllm_value(caches[layer], dst, head, row), pool[src, layer, 1, head, row])
    # And back: vLLM's blocks, as a socket sends them (each block's layers in order), into pdserve blocks.
    staging, _ = Regrouper(pd, vl).staging(2)
    staging.copy_(torch.stack([torch.stack([caches[layer][b] for layer in range(LAYERS)]) for b in target])
                  .view(2, LAYERS, -1).view(torch.uint8))
    back = torch.zeros_like(pool)
    Regrouper(pd, vl).regroup(staging, (back,), [0, 3])
    assert torch.equal(back[[0, 3]], pool[source])


def staged_as_vllm(staging: torch.Tensor, block: int, layer: int) -> torch.Tensor:
    return staging[block, layer].view(torch.float32).view(HEADS, BLOCK, 2 * DIM)


@pytest.mark.parametrize("layer", [None, 1], ids=["whole-blocks", "one-layer"])
def test_a_writer_stages_its_blocks_in_the_peers_layout(layer):
    pd, vl = layouts()
    pool = torch.randn(BLOCKS, LAYERS, 2, HEADS, BLOCK, DIM)
    source = [4, 1]
    staging, regions = Regrouper(pd, vl).ungroup((pool,), source, layer)
    assert regions.layer_bytes == HEADS * BLOCK * 2 * DIM * 4
    for index, src in enumerate(source):
        for at in range(LAYERS) if layer is None else (layer,):
            cache = staged_as_vllm(staging, index, at).unsqueeze(0)
            for head in range(HEADS):
                for row in (0, 7, BLOCK - 1):
                    assert torch.equal(vllm_key(cache, 0, head, row), pool[src, at, 0, head, row])
                    assert torch.equal(vllm_value(cache, 0, head, row), pool[src, at, 1, head, row])
    # And a vLLM writer's blocks staged as pdserve's: the same keys and values, token-major.
    caches = [torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]
    staging, _ = Regrouper(vl, pd).ungroup(caches, [5, 2], layer)
    staged = staging.view(torch.float32).view(2, LAYERS, 2, HEADS, BLOCK, DIM)
    for index, src in enumerate([5, 2]):
        for at in range(LAYERS) if layer is None else (layer,):
            for head in range(HEADS):
                for row in (0, 7, BLOCK - 1):
                    assert torch.equal(staged[index, at, 0, head, row], vllm_key(caches[at], src, head, row))
                    assert torch.equal(staged[index, at, 1, head, row], vllm_value(caches[at], src, head, row))


@pytest.mark.parametrize("change, why", [({"block": 64}, "block size 32 here, 64 at the peer"),
                                         ({"model": "other"}, "different model weights")])
def test_other_layouts_are_refused_naming_the_difference(change, why):
    pd, vl = layouts(**change)
    if "block" in change:
        vl = vllm_cpu_layout([torch.zeros(BLOCKS, HEADS, 64, 2 * DIM)] * LAYERS, 64, "weights")
    assert why in translation_refused(pd, vl)
    assert translation_refused(pd, layouts()[1]) == ""
    assert "both are pdserve layouts" in translation_refused(pd, pd)
    assert "does not describe" in translation_refused(pd, None)
