"""The native fused row-wise ops (RMSNorm, residual add + RMSNorm, SiLU * mul, rotary embedding + KV cache write)
against the plain-torch ops they replace: fp32 and bf16, one row (the calling thread) and many (split over
threads), rows that are views of a wider tensor, and activations large enough that torch's SiLU goes subnormal.
The engine's greedy tokens on them are checked, with the native attention, in test_native_attention.py."""

from __future__ import annotations

import pytest
import torch
from test_native_attention import native  # noqa: F401 - the fixture that builds the library

from pdserve.layers.attention import AttentionMetadata
from pdserve.layers.pointwise import TORCH_POINTWISE
from pdserve.layers.rotary import RotaryEmbedding
from pdserve.models.config import RopeConfig
from pdserve.native.backend import NATIVE_POINTWISE, pointwise_ops_for

DTYPES = [torch.float32, torch.bfloat16]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # fp32: sum-of-squares order; bf16: one ulp
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 130])
def test_rms_norms_equal_torch(native, dtype, rows) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(rows)
    wide = (torch.randn(rows, 2 * 96, generator=g) * 40).to(dtype)
    x = wide[:, :96]  # a strided view, as a split of a fused projection is
    residual = torch.randn(rows, 96, generator=g).to(dtype)
    weight = torch.randn(96, generator=g).to(dtype)
    close(NATIVE_POINTWISE.rms_norm(x, weight, 1e-6), TORCH_POINTWISE.rms_norm(x, weight, 1e-6), dtype)
    for got, want in zip(NATIVE_POINTWISE.add_rms_norm(x, residual, weight, 1e-5),
                         TORCH_POINTWISE.add_rms_norm(x, residual, weight, 1e-5), strict=True):
        close(got, want, dtype)
    heads = x.reshape(rows, 4, 24)  # a per-head norm (Qwen3's q/k norm) normalizes the last dim of 3-d input
    close(NATIVE_POINTWISE.rms_norm(heads, weight[:24], 1e-6), TORCH_POINTWISE.rms_norm(heads, weight[:24], 1e-6),
          dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,scale", [(1, 1.0), (70, 3.0), (70, 300.0)])
def test_silu_and_mul_equals_torch(native, dtype, rows, scale) -> None:  # noqa: F811
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1000, generator=g) * scale).to(dtype)
    got, want = NATIVE_POINTWISE.silu_and_mul(gate_up), TORCH_POINTWISE.silu_and_mul(gate_up)
    # Far below zero silu is a subnormal in torch and a tiny normal here; both are 0 to any later op.
    assert got.dtype == want.dtype and got.shape == (rows, 1000)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-30, rtol=2e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 1000])
def test_rotary_and_cache_equals_torch(native, dtype, tokens) -> None:  # noqa: F811
    """q, k and v are views of one fused projection, as in the model; the cache view is one layer of a pool of
    three (strided); every token goes to its own slot, scattered over the pool; 1000 tokens split over threads."""
    heads, kv_heads, head_dim, block, num_blocks = 6, 2, 32, 4, 512
    g = torch.Generator().manual_seed(tokens)
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 1024, dtype)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(dtype)
    positions = torch.randint(0, 1024, (tokens,), generator=g)
    slots = torch.randperm(num_blocks * block, generator=g)[:tokens]
    meta = AttentionMetadata(slot_block=slots // block, slot_offset=slots % block)
    pool = torch.randn(num_blocks, 3, 2, kv_heads, block, head_dim, generator=g).to(dtype)
    results = []
    for ops in (NATIVE_POINTWISE, TORCH_POINTWISE):
        q, k, v = qkv.clone().view(tokens, -1, head_dim).split((heads, kv_heads, kv_heads), dim=1)
        cache = pool.clone()
        results.append((*ops.rotary_and_cache(positions, q, k, v, rotary.cos, rotary.sin, cache[:, 1], meta),
                        cache))
    for got, want in zip(*results, strict=True):  # bit-equal: the same roundings, no FMA contraction
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert not torch.equal(results[0][2], pool)  # the step's K and V were written


def test_rotary_and_cache_refuses_slots_outside_the_cache(native) -> None:  # noqa: F811
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), 8, 16, torch.float32)
    q, k, v = torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)
    cache = torch.zeros(3, 2, 2, 4, 8)
    for position, block in ((16, 0), (0, 3)):
        meta = AttentionMetadata(slot_block=torch.tensor([block]), slot_offset=torch.tensor([0]))
        with pytest.raises(RuntimeError, match="past the rotary table|outside the cache"):
            NATIVE_POINTWISE.rotary_and_cache(torch.tensor([position]), q, k, v, rotary.cos, rotary.sin, cache, meta)


def test_engine_takes_fused_ops_with_the_native_library(native) -> None:  # noqa: F811
    assert pointwise_ops_for(native) is NATIVE_POINTWISE
    assert pointwise_ops_for(None) is TORCH_POINTWISE
