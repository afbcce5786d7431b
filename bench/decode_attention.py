"""Decode attention alone, native paged kernel against the plain-torch path, interleaved call by call.

One layer of a 12-layer pool in llama120m's shapes (12 heads over 4 KV heads, head_dim 64, blocks of 16), block
tables scattered over the pool, context lengths drawn from a range; each rep times one call of each path in
alternating order, so load from other processes lands on both alike. Prints medians and the ratio.

`--baseline REV` times this tree's native kernel against REV's instead (built from REV's sources into a cache of
its own): two libraries cannot both register torch.ops.pdserve in one process, so each runs in a worker process
of its own and the two take turns, a few calls at a time, on the same inputs.

    PYTHONPATH=. python bench/decode_attention.py --threads 2 --reps 200
    PYTHONPATH=. python bench/decode_attention.py --threads 2 --reps 200 --baseline main
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdserve.layers.attention import AttentionMetadata, _decode_attention
from pdserve.native.backend import choose_decode_kernel
from pdserve.native.build import ensure_built, load_library

LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK = 12, 4, 12, 64, 16
CASES = [(dtype, batch, lo, hi) for dtype in (torch.float32, torch.bfloat16)
         for batch, lo, hi in ((64, 128, 256), (1, 192, 192), (1, 576, 576))]
SLICE = 5  # calls a worker times before the other takes its turn
REPO = Path(__file__).resolve().parent.parent


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


def interleaved_medians(calls: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median ms of each call, one of each per rep, the order alternating so that load lands on all alike."""
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 else names[::-1]:
            times[name].append(timed(calls[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def make_case(batch: int, lo: int, hi: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q, one layer's view of the pool, and the torch path's metadata; the same on every call (seeded)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(lo, hi + 1, (batch,), generator=g).tolist()
    num_blocks = batch * (-(-hi // BLOCK)) + 8
    pool = torch.randn(num_blocks, LAYERS, 2, KV_HEADS, BLOCK, HEAD_DIM, generator=g).to(dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, pool[:, LAYERS // 2], make_meta(lengths, num_blocks, dtype, g)


def compare(batch: int, lo: int, hi: int, dtype: torch.dtype, reps: int) -> None:
    q, layer, meta = make_case(batch, lo, hi, dtype)
    native = AttentionMetadata(**{**{f: getattr(meta, f) for f in meta.__slots__},
                                  "decode_kernel": choose_decode_kernel("native", torch.device("cpu"), dtype)})
    calls = {"torch": lambda: _decode_attention(q, layer, meta, HEAD_DIM ** -0.5),
             "native": lambda: _decode_attention(q, layer, native, HEAD_DIM ** -0.5)}
    err = (calls["torch"]().float() - calls["native"]().float()).abs().max().item()
    medians = interleaved_medians(calls, reps)
    t, n = medians["torch"], medians["native"]
    print(f"| {str(dtype)[6:]} | {batch} | {lo}-{hi} | {t:.2f} | {n:.2f} | {t / n:.2f}x | {err:.1e} |", flush=True)


def build_baseline(rev: str) -> Path:
    """The native library of another revision, built from its sources into a cache of its own (kept between
    runs, one per commit)."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.strip()
    root = Path(tempfile.gettempdir()) / f"pdserve-bench-native-{commit[:12]}"
    archive = subprocess.run(["git", "archive", commit, "pdserve/__init__.py", "pdserve/native"], cwd=REPO,
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root / "src", filter="data")
    env = {"PYTHONPATH": str(root / "src"), "PDSERVE_NATIVE_CACHE": str(root / "cache")}
    # Run from the extracted sources: `-m` puts the working directory first on the path.
    built = subprocess.run([sys.executable, "-m", "pdserve.native"], env={**os.environ, **env}, cwd=root / "src",
                           capture_output=True, text=True, check=True)
    return Path(built.stdout.strip().rsplit(": ", 1)[1])


def serve(library: str) -> None:
    """Worker: loads one library, then for each line `case reps` on stdin times that many calls (after one
    untimed call per case) and answers their times in ms, and the largest difference from the torch path."""
    load_library(Path(library))
    cases: dict[int, tuple] = {}
    for line in sys.stdin:
        index, reps = map(int, line.split())
        if index not in cases:
            q, layer, meta = make_case(*CASES[index][1:], CASES[index][0])
            call = functools.partial(torch.ops.pdserve.paged_decode, q, layer, meta.decode_block_table,
                                     meta.decode_lengths, HEAD_DIM ** -0.5)
            err = (_decode_attention(q, layer, meta, HEAD_DIM ** -0.5).float() - call().float()).abs().max().item()
            cases[index] = (call, err)
        call, err = cases[index]
        print(json.dumps({"times": [timed(call) for _ in range(reps)], "err": err}), flush=True)


def versus(rev: str, threads: int, reps: int) -> None:
    """This tree's kernel against REV's, each in its own worker, turns alternating SLICE calls at a time."""
    libraries = {rev: build_baseline(rev), "this tree": ensure_built()}
    workers = {name: subprocess.Popen([sys.executable, __file__, "--threads", str(threads), "--worker", str(lib)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for name, lib in libraries.items()}
    print(f"| dtype | decodes | context | {rev} ms | this tree ms | {rev}/this | max abs diff vs torch ({rev} / this) |")
    print("|---|---:|---|---:|---:|---:|---|")
    try:
        for index, (dtype, batch, lo, hi) in enumerate(CASES):
            times: dict[str, list[float]] = {name: [] for name in workers}
            errs: dict[str, float] = {}
            for turn in range(-(-reps // SLICE)):
                for name in (list(workers) if turn % 2 else list(workers)[::-1]):
                    workers[name].stdin.write(f"{index} {SLICE}\n")
                    workers[name].stdin.flush()
                    answer = json.loads(workers[name].stdout.readline())
                    times[name].extend(answer["times"])
                    errs[name] = answer["err"]
            base, new = (statistics.median(times[name]) for name in workers)
            print(f"| {str(dtype)[6:]} | {batch} | {lo}-{hi} | {base:.3f} | {new:.3f} | {base / new:.2f}x "
                  f"| {errs[rev]:.1e} / {errs['this tree']:.1e} |", flush=True)
    finally:
        for worker in workers.values():
            worker.stdin.close()
            worker.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--baseline", help="a git revision whose native kernel to time this tree's against")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        if args.worker:
            return serve(args.worker)
        if args.baseline:
            return versus(args.baseline, args.threads, args.reps)
        print("| dtype | decodes | context | torch ms | native ms | torch/native | max abs diff |")
        print("|---|---:|---|---:|---:|---:|---:|")
        for dtype, batch, lo, hi in CASES:
            compare(batch, lo, hi, dtype, args.reps)


if __name__ == "__main__":
    main()
