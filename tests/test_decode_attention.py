"""Decode attention's two plain-torch paths (grouped matmuls for fp32 batches, SDPA otherwise) agree: a request
attended in a batch of decodes of other lengths gets what it gets alone, in fp32 and in bf16."""

import pytest
import torch

from pdserve.layers.attention import AttentionMetadata, paged_attention

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 4, 6, 2, 8


def decode(q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], lengths: list[int]
           ) -> torch.Tensor:
    max_blocks = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    visible = torch.arange(max_blocks * BLOCK).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
    # This step's own token goes to its last position: the slot is taken from each table.
    slots = [(t[(n - 1) // BLOCK], (n - 1) % BLOCK) for t, n in zip(tables, lengths)]
    meta = AttentionMetadata(slot_block=torch.tensor([b for b, _ in slots]), slot_offset=torch.tensor([o for _, o in slots]),
                             num_decode_tokens=len(tables), decode_block_table=table,
                             decode_bias=bias.view(len(tables), 1, 1, -1))
    return paged_attention(q, k, k.clone(), cache, meta, HEAD_DIM ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_equals_each_request_alone(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(16, 2, KV_HEADS, BLOCK, HEAD_DIM, generator=g).to(dtype)
    tables, lengths = [[3, 7, 1], [5], [9, 2]], [11, 3, 6]
    q = torch.randn(3, HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(3, KV_HEADS, HEAD_DIM, generator=g).to(dtype)  # this step's keys (and values)
    batched = decode(q, k, cache.clone(), tables, lengths)
    alone = torch.cat([decode(q[i:i + 1], k[i:i + 1], cache.clone(), [tables[i]], [lengths[i]]) for i in range(3)])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(batched.float(), alone.float(), atol=tolerance, rtol=tolerance)
    assert not torch.isnan(batched).any()
