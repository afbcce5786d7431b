"""The native paged decode attention against the plain-torch path it replaces, and the engine on it.

Kernel: random multi-layer pools (so a layer's view is strided, as in the engine), block tables scattered over
the pool, context lengths at and around block edges, GQA and MHA, fp32 and bf16. Engine: greedy tokens with the
native kernel equal those of the torch path, and transformers' fp32 reference where the oracle tests compare.
The backend choice falls back to torch when the library is not built.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import random_prompt
from test_oracle import NUM_TOKENS, PROMPT_LENGTHS, check_against_hf, greedy_params

from pdserve.layers.attention import AttentionMetadata, paged_attention
from pdserve.native.backend import choose_decode_kernel, requested_backend

LAYERS, HEAD_DIM = 3, 16
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def native():
    if shutil.which(os.environ.get("CXX", "c++")) is None and os.environ.get("CI") != "true":
        pytest.skip("no C++ compiler: the engine runs the torch path")
    return choose_decode_kernel("native", CPU, torch.float32)  # builds into the cache if it is not there yet


def decode_meta(tables: list[list[int]], lengths: list[int], block: int, dtype: torch.dtype) -> AttentionMetadata:
    max_blocks = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    visible = torch.arange(max_blocks * block).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    bias = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    # This step's own token goes to its last position.
    slots = [(t[(n - 1) // block], (n - 1) % block) for t, n in zip(tables, lengths)]
    return AttentionMetadata(slot_block=torch.tensor([b for b, _ in slots]),
                             slot_offset=torch.tensor([o for _, o in slots]), num_decode_tokens=len(tables),
                             decode_block_table=table, decode_bias=bias.view(len(tables), 1, 1, -1),
                             decode_lengths=torch.tensor(lengths))


# head_dim 16 takes the portable loops, 64 and 128 the AVX-512 ones where the CPU has them (query heads four at a
# time: a group of five is one pass of four and one of one; blocks of 32 are two passes of sixteen tokens).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (10, 2)], ids=["gqa", "mha", "gqa5"])
@pytest.mark.parametrize("block", [4, 16, 32])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 128])
def test_native_kernel_equals_torch_path(native, dtype, heads, kv_heads, block, head_dim) -> None:
    g = torch.Generator().manual_seed(block * 100 + heads + head_dim)
    lengths = [1, block - 1, block + 1, 3 * block + 2, 2 * block, 5]
    num_blocks = 64
    pool = torch.randn(num_blocks, LAYERS, 2, kv_heads, block, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()  # disjoint tables, scattered over the pool
    tables, used = [], 0
    for n in lengths:
        count = -(-n // block)
        tables.append(order[used:used + count])
        used += count
    q = torch.randn(len(lengths), heads, head_dim, generator=g).to(dtype)
    k = torch.randn(len(lengths), kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(len(lengths), kv_heads, head_dim, generator=g).to(dtype)
    outs = {}
    for name, kernel in (("torch", None), ("native", native)):
        meta = decode_meta(tables, lengths, block, dtype)
        meta.decode_kernel = kernel
        outs[name] = paged_attention(q, k, v, pool.clone()[:, 1], meta, head_dim ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs["native"].float(), outs["torch"].float(), atol=tol, rtol=tol)
    assert outs["native"].dtype == dtype


def test_engine_greedy_tokens_native_equal_torch(native, llama_dir, make_llm) -> None:
    prompts = [random_prompt(n, seed=600 + n) for n in (1, 15, 17, 40, 90)]
    tokens = {}
    for backend in ("torch", "native"):
        llm = make_llm(llama_dir, block_size=16, attention_backend=backend)
        assert (llm.engine.runner.decode_kernel is not None) == (backend == "native")
        results = llm.generate(prompts, greedy_params(24))  # decoded as one batch of five
        tokens[backend] = [r.outputs[0].token_ids for r in results]
    assert tokens["native"] == tokens["torch"]


def test_engine_on_native_kernel_matches_transformers(native, models, make_llm, hf_models) -> None:
    prompts = [random_prompt(n, seed=n) for n in PROMPT_LENGTHS]
    compared = check_against_hf(make_llm, hf_models, models("qwen3"), prompts, "qwen3 native",
                                attention_backend="native")
    assert compared >= len(prompts) * NUM_TOKENS // 2


def test_backend_choice_falls_back_to_torch(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("PDSERVE_ATTENTION_BACKEND", raising=False)  # a run under =native would fail on fp16
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE", str(tmp_path / "empty"))  # nothing built there
    assert choose_decode_kernel("auto", CPU, torch.float32) is None
    assert choose_decode_kernel(None, CPU, torch.float16) is None  # a dtype the kernel lacks
    assert choose_decode_kernel("torch", CPU, torch.float32) is None
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "torch")
    assert requested_backend(None) == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        requested_backend("flash")
