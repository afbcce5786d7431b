"""Decode attention alone, native paged kernel against the plain-torch path, interleaved call by call.

One layer of a 12-layer pool in llama120m's shapes (12 heads over 4 KV heads, head_dim 64, blocks of 16), block
tables scattered over the pool, context lengths drawn from a range; each rep times one call of each path in
alternating order, so load from other processes lands on both alike. Prints medians and the ratio.

    PYTHONPATH=. python bench/decode_attention.py --threads 2 --reps 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.layers.attention import AttentionMetadata, _decode_attention
from pdserve.native.backend import choose_decode_kernel

LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK = 12, 4, 12, 64, 16


def make_meta(lengths: list[int], num_blocks: int, dtype: torch.dtype, g: torch.Generator) -> AttentionMetadata:
    max_blocks = -(-max(lengths) // BLOCK)
    table = torch.randperm(num_blocks, generator=g)[:len(lengths) * max_blocks].view(len(lengths), max_blocks)
    visible = torch.arange(max_blocks * BLOCK).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    bias = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return AttentionMetadata(slot_block=torch.zeros(0, dtype=torch.long), slot_offset=torch.zeros(0, dtype=torch.long),
                             num_decode_tokens=len(lengths), decode_block_table=table,
                             decode_bias=bias.view(len(lengths), 1, 1, -1), decode_lengths=torch.tensor(lengths))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def compare(batch: int, lo: int, hi: int, dtype: torch.dtype, reps: int) -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(lo, hi + 1, (batch,), generator=g).tolist()
    num_blocks = batch * (-(-hi // BLOCK)) + 8
    pool = torch.randn(num_blocks, LAYERS, 2, KV_HEADS, BLOCK, HEAD_DIM, generator=g).to(dtype)
    layer = pool[:, LAYERS // 2]
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    meta = make_meta(lengths, num_blocks, dtype, g)
    native = AttentionMetadata(**{**{f: getattr(meta, f) for f in meta.__slots__},
                                  "decode_kernel": choose_decode_kernel("native", torch.device("cpu"), dtype)})
    calls = {"torch": lambda: _decode_attention(q, layer, meta, HEAD_DIM ** -0.5),
             "native": lambda: _decode_attention(q, layer, native, HEAD_DIM ** -0.5)}
    err = (calls["torch"]().float() - calls["native"]().float()).abs().max().item()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(reps):
        for name in (("torch", "native") if rep % 2 else ("native", "torch")):
            times[name].append(timed(calls[name]))
    t, n = statistics.median(times["torch"]), statistics.median(times["native"])
    print(f"| {str(dtype)[6:]} | {batch} | {lo}-{hi} | {t:.2f} | {n:.2f} | {t / n:.2f}x | {err:.1e} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| dtype | decodes | context | torch ms | native ms | torch/native | max abs diff |")
    print("|---|---:|---|---:|---:|---:|---:|")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for batch, lo, hi in ((64, 128, 256), (1, 192, 192), (1, 576, 576)):
                compare(batch, lo, hi, dtype, args.reps)


if __name__ == "__main__":
    main()
