"""What reading a chat prompt and picking an instance for it costs kv_aware, per request, with the index in C (its
events and routing's queries) and the chat template through minijinja, against the index in Python and jinja2, side
by side in one process.

The routing bench's workloads (bench/routing.py: shared system prompts, multi-turn conversations, unique prompts)
go through the gateway's own code, as its public seams take them: `PromptTokenizer.prompt` (the chat template, the
pieces, tiktoken), then `KvAware.pick` over four instances, whose KV events come back as `BlockStored` batches
three requests later (the instances' own token ids, from the model's tokenizer). CPU is the thread's, per request,
median over the rounds; the configurations alternate in every round. This is the hot cost of routing's own
Python and C; the live gateway, where each part runs among the HTTP work and the engines, costs several times it
(benchmarks section 14), and the routing bench's CPU per request is the figure the target reads.

    .venv/bin/python bench/kv_pick_cpu.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
from harness import rotations  # noqa: E402
from routing import WORKLOADS, Shape, build, order  # noqa: E402

from pdserve.kv_events.index import PrefixIndex, content_keys  # noqa: E402
from pdserve.kv_events.policy import KvAware  # noqa: E402
from pdserve.kv_events.prompt import PromptTokenizer  # noqa: E402
from pdserve.kv_events.wire import BlockStored  # noqa: E402

BS, INSTANCES, LAG = 16, 4, 3
# name -> (the index in C: events and queries; minijinja for the chat template)
CONFIGS = {"C + minijinja": (True, True), "C + jinja2": (True, False), "Python + jinja2": (False, False)}


def bodies(workload: str, salt: str) -> list[dict]:
    """The workload's requests, every message salted: no round finds another's blocks or remembered pieces."""
    convs = build(workload, Shape())
    return [{"messages": [{**m, "content": f"[{salt}] {m['content']}"} for m in turn], "max_tokens": 8}
            for c in order(convs) for turn in convs[c]]


def run(tokenizer: PromptTokenizer, requests: list[dict], stored: list[list[int]], native: bool) -> float:
    """Thread CPU µs per request of reading and picking every request, into a fresh index; `stored`: each
    request's ids as its instance publishes them."""
    index = PrefixIndex(native_core=native)
    policy = KvAware(index)
    instances = [SimpleNamespace(url=f"i{n}", pending_tokens=0, active_tokens=0, in_flight=0) for n in range(INSTANCES)]
    for instance in instances:
        index.join(instance.url, BS)
    in_flight: list[tuple[str, list[int]]] = []
    start = time.thread_time()
    for body, ids in zip(requests, stored):
        chosen = policy.pick(instances, b"", tokenizer.prompt(body))
        in_flight.append((chosen.url, ids))
        if len(in_flight) > LAG:  # an instance computed a prompt: its events come
            member, ids = in_flight.pop(0)
            whole = len(ids) // BS * BS
            index.apply(member, [BlockStored(block_hashes=content_keys(ids, BS), parent_block_hash=None,
                                             token_ids=ids[:whole], block_size=BS, lora_id=None, medium="GPU",
                                             lora_name=None)])
    return (time.thread_time() - start) / len(requests) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default=None, help="a model folder (default: the generated h256 model)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else make_model(Path(tmp))
        if not PrefixIndex().native:
            sys.exit("the C core is not built here: python -m pdserve.kv_events.native")
        ids_of = PromptTokenizer(model, minijinja=False)  # the instances' ids (jinja2, as theirs), before any timing
        tokenizers = {name: PromptTokenizer(model, PrefixIndex(native_core=native).keys_of, minijinja)
                      for name, (native, minijinja) in CONFIGS.items()}
        for workload in WORKLOADS:
            times: dict[str, list[float]] = {name: [] for name in CONFIGS}
            for rnd, names in rotations(list(CONFIGS), args.rounds):
                requests = bodies(workload, f"{workload}{rnd}")
                stored = [ids_of.encode(ids_of.render_chat(b), add_special_tokens=False) for b in requests]
                for name in names:
                    times[name].append(run(tokenizers[name], requests, stored, CONFIGS[name][0]))
            medians = {name: statistics.median(v) for name, v in times.items()}
            base = medians["Python + jinja2"]
            print(f"{workload}: " + "; ".join(f"{name} {m:.1f} us ({m / base:.2f})" for name, m in medians.items())
                  + " per request; rounds " + "; ".join(f"{n}: {', '.join(f'{v:.0f}' for v in t)}"
                                                        for n, t in times.items()), flush=True)


def make_model(root: Path) -> Path:
    from pdserve.modelgen import make_text_model

    return Path(make_text_model("llama", root / "h256", preset="h256"))


if __name__ == "__main__":
    main()
