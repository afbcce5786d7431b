"""Prefill attention alone, the native paged kernel against the plain-torch path (SDPA per chunk), interleaved.

One layer of a 12-layer pool in llama120m's shapes (12 heads over 4 KV heads, head_dim 64, blocks of 16), each
case one prefill chunk whose keys (context + its own) are already in scattered blocks of the pool, as the fused
rotary op leaves them: a whole prompt (no context) of 512, 2048 and 8192 tokens, and the last 2048-token chunk of
an 8192-token prompt prefilled in chunks of 2048 (6144 tokens of context). Each rep times one call of each path, in
alternating order, so load from other processes lands on both alike. Prints medians, the ratio, the largest
difference between the two and each path's rate (causal attention FLOPs per second).

    PYTHONPATH=. python bench/prefill_attention.py --threads 2 --reps 20
"""

from __future__ import annotations

import argparse

import torch

from pdserve.layers.attention import AttentionMetadata, PrefillChunk, attend_written
from pdserve.native.backend import choose_decode_kernel, prefill_kernel_for

from decode_attention import interleaved_medians  # bench/, on sys.path when run as a script

LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK = 12, 4, 12, 64, 16
CASES = [(dtype, context, new) for dtype in (torch.float32, torch.bfloat16)
         for context, new in ((0, 512), (0, 2048), (6144, 2048), (0, 8192))]


def make_case(context: int, new: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q (a strided view, as the fused projection's split gives it), one layer's view of the pool, and the torch
    path's metadata for one chunk; the same on every call (seeded)."""
    g = torch.Generator().manual_seed(0)
    total = context + new
    blocks = -(-total // BLOCK)
    pool = torch.randn(blocks + 8, LAYERS, 2, KV_HEADS, BLOCK, HEAD_DIM, generator=g).to(dtype)
    table = torch.randperm(blocks + 8, generator=g)[:blocks]
    qkv = torch.randn(new, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    meta = AttentionMetadata(slot_block=torch.zeros(0, dtype=torch.long), slot_offset=torch.zeros(0, dtype=torch.long),
                             prefills=[PrefillChunk(0, new, context, table)])
    return qkv, pool[:, LAYERS // 2], meta


def compare(dtype: torch.dtype, context: int, new: int, reps: int) -> None:
    qkv, layer, meta = make_case(context, new, dtype)
    q, k, v = qkv.split_with_sizes((HEADS, KV_HEADS, KV_HEADS), dim=1)
    if context == 0:  # the torch path reads a whole prompt's keys from the projection, not from the cache
        total = layer.permute(1, 2, 0, 3, 4).index_select(2, meta.prefills[0].block_ids)
        k = total[0].reshape(KV_HEADS, -1, HEAD_DIM)[:, :new].transpose(0, 1)
        v = total[1].reshape(KV_HEADS, -1, HEAD_DIM)[:, :new].transpose(0, 1)
    kernel = prefill_kernel_for(choose_decode_kernel("native", torch.device("cpu"), dtype), dtype)
    native = AttentionMetadata(**{**{f: getattr(meta, f) for f in meta.__slots__}, "prefill_kernel": kernel,
                                  "prefill_spans": torch.tensor([[0, new, context]]),
                                  "prefill_tables": meta.prefills[0].block_ids.unsqueeze(0)})
    scale = HEAD_DIM ** -0.5
    calls = {"torch": lambda: attend_written(q, k, v, layer, meta, scale),
             "native": lambda: attend_written(q, k, v, layer, native, scale)}
    err = (calls["torch"]().float() - calls["native"]().float()).abs().max().item()
    medians = interleaved_medians(calls, reps)
    t, n = medians["torch"], medians["native"]
    flops = 4 * HEADS * HEAD_DIM * new * (context + (new + 1) / 2)
    print(f"| {str(dtype)[6:]} | {context} | {new} | {t:.2f} | {n:.2f} | {t / n:.2f}x | {flops / t / 1e6:.0f} / "
          f"{flops / n / 1e6:.0f} | {err:.1e} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, medians of {args.reps}")
    print("| dtype | context | new tokens | torch ms | native ms | torch/native | GFLOP/s torch / native | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    with torch.inference_mode():
        for dtype, context, new in CASES:
            compare(dtype, context, new, args.reps)


if __name__ == "__main__":
    main()
