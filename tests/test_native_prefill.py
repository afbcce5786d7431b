"""The native paged prefill attention against the plain-torch path (SDPA per chunk over its gathered context).

Steps as the engine builds them: decodes first, then several prefill chunks, some with cached context (chunked
prefill), some not, each chunk's keys already written to blocks scattered over a multi-layer pool (so a layer's
view is strided); GQA and MHA, head sizes the AVX-512 loops take and one they leave to the portable loops, blocks
of 16 and 32, fp32 and bf16, chunks shorter and longer than a key tile (256). The engine-level checks (greedy tokens
against transformers with chunked prefill on, native against torch) are in tests/test_oracle.py and
tests/test_native_attention.py, which run on whatever backend the engine chose.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from pdserve.layers.attention import AttentionMetadata, PrefillChunk, attend_written, write_kv
from pdserve.native.backend import choose_decode_kernel, prefill_kernel_for

LAYERS = 3
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def decode_kernel():
    if shutil.which(os.environ.get("CXX", "c++")) is None and os.environ.get("CI") != "true":
        pytest.skip("no C++ compiler: the engine runs the torch path")
    return choose_decode_kernel("native", CPU, torch.float32)  # builds into the cache if it is not there yet


def prefill_kernel(decode_kernel, dtype: torch.dtype):
    kernel = prefill_kernel_for(decode_kernel, dtype)
    if kernel is None:
        pytest.skip(f"oneDNN's micro-kernels do not serve {dtype} on this CPU: prefill takes SDPA")
    return kernel


def make_step(chunks: list[tuple[int, int]], decodes: list[int], block: int, kv_heads: int, head_dim: int,
              dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, AttentionMetadata, list[list[int]]]:
    """A pool whose blocks hold every sequence's context, and the step's metadata (with each new token's slot):
    `decodes` are context lengths (their own token included), `chunks` (context, new tokens) pairs. Returns (pool,
    metadata, tables)."""
    lengths = decodes + [context + new for context, new in chunks]
    counts = [-(-n // block) for n in lengths]
    pool = torch.randn(sum(counts) + 4, LAYERS, 2, kv_heads, block, head_dim, generator=g).to(dtype)
    order = torch.randperm(sum(counts) + 4, generator=g).tolist()  # disjoint tables, scattered over the pool
    tables = [order[sum(counts[:i]):sum(counts[:i + 1])] for i in range(len(lengths))]
    max_blocks = max(counts)
    prefills, row = [], len(decodes)
    slots = [(table, n - 1) for table, n in zip(tables, decodes)]
    for (context, new), table in zip(chunks, tables[len(decodes):], strict=True):
        prefills.append(PrefillChunk(row, row + new, context, torch.tensor(table)))
        slots += [(table, p) for p in range(context, context + new)]
        row += new
    meta = AttentionMetadata(slot_block=torch.tensor([t[p // block] for t, p in slots]),
                             slot_offset=torch.tensor([p % block for _, p in slots]), num_decode_tokens=len(decodes),
                             prefills=prefills)
    if decodes:
        meta.decode_block_table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables[:len(decodes)]])
        meta.decode_lengths = torch.tensor(decodes)
    return pool, meta, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 4, 64), (4, 4, 128), (10, 2, 32), (6, 2, 24)],
                         ids=["gqa3-64", "mha-128", "gqa5-32", "gqa3-24"])
@pytest.mark.parametrize("block", [16, 32])
def test_native_prefill_equals_torch_path(decode_kernel, dtype, heads, kv_heads, head_dim, block) -> None:
    g = torch.Generator().manual_seed(block * 1000 + heads * 10 + head_dim)
    # Whole prompts (1 token, under a block, over a key tile), chunks after cached context (a block edge, mid-block,
    # several tiles), and two decodes in front, as the engine orders a mixed step.
    chunks = [(0, 1), (0, block - 3), (0, 300), (block, 40), (37, 5), (290, 270)]
    pool, meta, _ = make_step(chunks, [9, 3 * block + 1], block, kv_heads, head_dim, dtype, g)
    layer = pool[:, 1]
    rows = meta.num_decode_tokens + sum(new for _, new in chunks)
    qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    q, k, v = qkv.split_with_sizes((heads, kv_heads, kv_heads), dim=1)  # strided views, as the projection's split
    write_kv(layer, k, v, meta)  # as the rotary op does before attention
    meta.decode_kernel = decode_kernel
    torch_out = attend_written(q, k, v, layer, meta, head_dim ** -0.5)
    meta.prefill_kernel = prefill_kernel(decode_kernel, dtype)
    meta.prefill_spans = torch.tensor([[c.start, c.end, c.num_context_tokens] for c in meta.prefills])
    width = max(len(c.block_ids) for c in meta.prefills)
    meta.prefill_tables = torch.stack([torch.nn.functional.pad(c.block_ids, (0, width - len(c.block_ids)))
                                       for c in meta.prefills])
    native_out = attend_written(q, k, v, layer, meta, head_dim ** -0.5)
    assert native_out.dtype == dtype and native_out.is_contiguous()
    # The torch path rounds its bf16 products and probabilities where SDPA does; the kernel where brgemm does.
    tol = 2e-6 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(native_out.float(), torch_out.float(), atol=tol, rtol=tol)


def test_prefill_kernel_choice(decode_kernel) -> None:
    assert prefill_kernel_for(None, torch.float32) is None  # no native library: SDPA per chunk
    assert prefill_kernel_for(decode_kernel, torch.float16) is None  # a dtype the kernel lacks
    assert not torch.ops.pdserve.prefill_supported(torch.float16)


def test_native_prefill_refuses_blocks_outside_the_cache(decode_kernel) -> None:
    kernel = prefill_kernel(decode_kernel, torch.float32)
    g = torch.Generator().manual_seed(7)
    pool, meta, tables = make_step([(0, 20)], [], 16, 2, 32, torch.float32, g)
    q = torch.randn(20, 4, 32, generator=g)
    out = torch.empty_like(q)
    spans = torch.tensor([[0, 20, 0]])
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel(q, pool[:, 0], out, spans, torch.tensor([[tables[0][0], pool.shape[0]]]), 0.1)
    with pytest.raises(RuntimeError, match="exceed its block table"):
        kernel(q, pool[:, 0], out, spans, torch.tensor([[tables[0][0]]]), 0.1)
    with pytest.raises(RuntimeError, match="outside the 20 query rows"):
        kernel(q, pool[:, 0], out, torch.tensor([[5, 21, 0]]), torch.tensor([tables[0]]), 0.1)
