"""Paged attention on plain torch ops.

The KV cache is one tensor ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``: a block's KV for
every layer is one contiguous chunk, so a transfer moves a block with one copy, while a layer's K (or V) is a
strided view ``[num_blocks, num_kv_heads, block_size, head_dim]`` that attention gathers from.

A step's flat batch puts decode tokens (one per request) first, then prefill chunks. Decodes are attended over a
padded block table in one call: the native kernel reading the blocks in place when the engine has it
(pdserve.native), else SDPA or grouped matmuls (fp32 batches) over a gathered copy. Prefill chunks likewise: every
chunk of the step in one call of the native kernel, which reads its context and its own keys from the blocks in
place, else each chunk through SDPA with its cached context gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# (q [decodes, heads, head_dim], one layer's cache view, block table, context lengths, scale) -> like q
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# (q [tokens, heads, head_dim], one layer's cache view, out (dense, like q: the chunks' rows are written), spans
# [chunks, 3], block tables [chunks, max_blocks], scale) -> None
PrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], None]


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first row of this chunk in the flat batch
    end: int
    num_context_tokens: int  # tokens of this request already in the cache before this chunk
    block_ids: torch.Tensor  # blocks covering context + chunk, in order


@dataclass(slots=True)
class AttentionMetadata:
    slot_block: torch.Tensor  # [num_tokens] block id each new token's KV is written to
    slot_offset: torch.Tensor  # [num_tokens] offset inside that block
    num_decode_tokens: int = 0
    decode_block_table: torch.Tensor | None = None  # [num_decodes, max_blocks], padded with block 0
    decode_bias: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size]: 0 or -inf, q's dtype
    decode_lengths: torch.Tensor | None = None  # [num_decodes] context length of each decode, its own token included
    decode_kernel: DecodeKernel | None = None  # reads the blocks in place; None: the torch path (needs decode_bias)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The native path's view of the same chunks: (start, end, context) rows and block tables padded with block 0.
    prefill_spans: torch.Tensor | None = None
    prefill_tables: torch.Tensor | None = None
    prefill_kernel: PrefillKernel | None = None  # reads the blocks in place; None: SDPA per chunk
    # Rows that sample (batch order), where some do not: the last layer computes past its KV write only for them,
    # attended as decodes over their sequences so far (`sampled`).
    sampled_rows: torch.Tensor | None = None
    sampled: AttentionMetadata | None = None

    def to(self, device: torch.device) -> AttentionMetadata:
        """The same metadata with every tensor on `device`. The runner builds it on the host (small lists turned
        into tensors) and a GPU engine moves it once per step: kernels index the cache with these tensors, and
        CUDA ops take no host index or mask beside device operands."""
        moved = AttentionMetadata(**{name: _on(getattr(self, name), device) for name in _META_FIELDS})
        moved.prefills = [PrefillChunk(c.start, c.end, c.num_context_tokens, _on(c.block_ids, device))
                          for c in self.prefills]
        moved.sampled = None if self.sampled is None else self.sampled.to(device)
        return moved


_META_FIELDS = tuple(name for name in AttentionMetadata.__slots__ if name not in ("prefills", "sampled"))


def _on(value: object, device: torch.device) -> object:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """layer_cache: [num_blocks, 2, kv_heads, block_size, head_dim] view of one layer."""
    layer_cache[meta.slot_block, 0, :, meta.slot_offset, :] = k
    layer_cache[meta.slot_block, 1, :, meta.slot_offset, :] = v


def gather_context(layer_cache: torch.Tensor, block_ids: torch.Tensor, length: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence as [kv_heads, length, head_dim]."""
    kv = gather_blocks(layer_cache, block_ids)  # [2, kv_heads, n, block_size, head_dim]
    _, kv_heads, n, block_size, head_dim = kv.shape
    kv = kv.view(2, kv_heads, n * block_size, head_dim)[:, :, :length].to(dtype)
    return kv[0], kv[1]


def gather_blocks(layer_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The given blocks of one layer as [2, kv_heads, len(block_ids), block_size, head_dim], in one copy.

    Selecting along the block axis of the head-major view lays every head's context out contiguously right
    away; selecting whole blocks and permuting afterwards costs a second copy and, measured on a 12-layer cache
    whose layer views are strided, 3x the time (docs/benchmarks.md).
    """
    return layer_cache.permute(1, 2, 0, 3, 4).index_select(2, block_ids)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim]. Returns [tokens, heads, head_dim]."""
    write_kv(layer_cache, k, v, meta)
    return attend_written(q, k, v, layer_cache, meta, scale)


def attend_written(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """paged_attention once this step's k and v are in the cache (a fused rotary embedding wrote them)."""
    nd = meta.num_decode_tokens
    if nd == q.shape[0]:  # decodes only, the steady state: their output is the whole output, no copy into one
        return _decode_attention(q, layer_cache, meta, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # dense, whatever q's strides
    if nd:
        out[:nd] = _decode_attention(q[:nd], layer_cache, meta, scale)
    if meta.prefill_kernel is not None:
        assert meta.prefill_spans is not None and meta.prefill_tables is not None
        meta.prefill_kernel(q, layer_cache, out, meta.prefill_spans, meta.prefill_tables, scale)
        return out
    for chunk in meta.prefills:
        out[chunk.start:chunk.end] = _prefill_attention(q, k, v, layer_cache, chunk, scale)
    return out


def _decode_attention(q: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    nd = q.shape[0]
    table = meta.decode_block_table
    assert table is not None
    if meta.decode_kernel is not None:
        assert meta.decode_lengths is not None
        return meta.decode_kernel(q, layer_cache, table, meta.decode_lengths, scale)
    assert meta.decode_bias is not None
    kv = gather_blocks(layer_cache, table.reshape(-1))  # [2, kv_heads, nd * max_blocks, block_size, head_dim]
    kv_heads, head_dim = kv.shape[1], kv.shape[4]
    kv = kv.view(2, kv_heads, nd, -1, head_dim)
    if q.dtype == torch.float32 and nd > 1:
        return _grouped_matmul_attention(q, kv, meta.decode_bias, scale)
    # SDPA's CPU kernel reads the strided view in place, keeps softmax in fp32 for bf16 inputs and never builds the
    # scores tensor: 2-3x faster than the matmuls over fp32 upcasts in bf16, and at batch 1 (docs/decisions.md).
    kv = kv.transpose(1, 2)  # [2, nd, kv_heads, context, head_dim], strided
    out = F.scaled_dot_product_attention(q.unsqueeze(2), kv[0], kv[1], attn_mask=meta.decode_bias, scale=scale,
                                         enable_gqa=True)
    return out.squeeze(2)


def _grouped_matmul_attention(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 batched decode: each KV head's query group is one small GEMM, so a key is read once per group, where
    SDPA reads it once per query head (12-25 % slower at 64 decodes, GQA 3)."""
    nd, heads, head_dim = q.shape
    keys, values = kv[0], kv[1]  # head-major: [kv_heads, nd, context, head_dim]
    qg = q.view(nd, kv.shape[1], heads // kv.shape[1], head_dim).transpose(0, 1)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(scale).add_(bias.view(1, nd, 1, -1))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).transpose(0, 1).reshape(nd, heads, head_dim)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
                       chunk: PrefillChunk, scale: float) -> torch.Tensor:
    qc = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, heads, T, hd]
    num_new = chunk.end - chunk.start
    if chunk.num_context_tokens == 0:
        kc = k[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
        vc = v[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=True)
    else:
        total = chunk.num_context_tokens + num_new
        keys, values = gather_context(layer_cache, chunk.block_ids, total, q.dtype)
        # Query i sits at absolute position context + i and may see keys up to and including that position.
        query_pos = torch.arange(chunk.num_context_tokens, total, device=q.device).unsqueeze(1)
        allowed = torch.arange(total, device=q.device).unsqueeze(0) <= query_pos
        out = F.scaled_dot_product_attention(qc, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=allowed,
                                             scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
