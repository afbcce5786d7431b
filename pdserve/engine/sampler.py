"""Turning a step's logits into tokens: penalties, min_tokens, greedy or random sampling, logprobs.

Logprobs are taken from the raw model distribution, before penalties and temperature, as vLLM v1 does by
default. Random sampling uses the exponential race (argmax p_i / E_i with E_i ~ Exp(1)), which draws exactly
from p and lets each seeded request own its generator, so its samples do not depend on its batch neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.outputs import ScheduledRequest
from pdserve.engine.request import TokenLogprobs


@dataclass(slots=True)
class SamplerResult:
    token_ids: list[int]
    logprobs: dict[int, TokenLogprobs]  # row -> logprobs, only for rows that asked


def sample(logits: torch.Tensor, rows: list[ScheduledRequest], generators: list[torch.Generator | None],
           default_generator: torch.Generator) -> SamplerResult:
    """logits: [len(rows), vocab] float32. generators[i] is row i's own generator when it has a seed."""
    raw_logprobs = None
    if any(r.sampling_params.logprobs is not None for r in rows):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    logits = _apply_penalties(logits, rows)
    logits = _mask_stops_before_min_tokens(logits, rows)
    tokens = first_argmax(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.sampling_params.is_greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        drawn = _sample_random(logits.index_select(0, index), [rows[i] for i in random_rows],
                               [generators[i] for i in random_rows], default_generator)
        tokens.index_copy_(0, index, drawn)
    token_list = tokens.tolist()
    logprobs = {}
    if raw_logprobs is not None:
        for i, r in enumerate(rows):
            if r.sampling_params.logprobs is not None:
                logprobs[i] = _token_logprobs(raw_logprobs[i], token_list[i], r.sampling_params.logprobs)
    return SamplerResult(token_list, logprobs)


def _apply_penalties(logits: torch.Tensor, rows: list[ScheduledRequest]) -> torch.Tensor:
    penalized = [i for i, r in enumerate(rows) if r.sampling_params.uses_penalties]
    if not penalized:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in penalized:
        params = rows[i].sampling_params
        output = torch.tensor(rows[i].output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)
        row = logits[i]
        if params.repetition_penalty != 1.0:
            prompt = torch.tensor(rows[i].prompt_token_ids, dtype=torch.long, device=logits.device)
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            seen[prompt[prompt < vocab]] = True
            seen |= counts > 0
            scaled = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
            row = torch.where(seen, scaled, row)
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
        logits[i] = row
    return logits


def _mask_stops_before_min_tokens(logits: torch.Tensor, rows: list[ScheduledRequest]) -> torch.Tensor:
    cloned = False
    for i, r in enumerate(rows):
        params = r.sampling_params
        if len(r.output_token_ids) >= params.min_tokens:
            continue
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(r.eos_token_ids))
        banned = [t for t in banned if 0 <= t < logits.shape[1]]
        if not banned:
            continue
        if not cloned:
            logits, cloned = logits.clone(), True
        logits[i, banned] = float("-inf")
    return logits


def _sample_random(logits: torch.Tensor, rows: list[ScheduledRequest], generators: list[torch.Generator | None],
                   default_generator: torch.Generator) -> torch.Tensor:
    params = [r.sampling_params for r in rows]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device).unsqueeze(1)
    logits = logits / temperature
    if any(p.min_p > 0 for p in params):
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device).unsqueeze(1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if any(p.top_k > 0 for p in params):
        logits = _top_k(logits, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        logits = _top_p(logits, torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device))
    probs = torch.softmax(logits, dim=-1)
    # Drawn on the host whatever the device: the generators are host generators, so a seeded request's stream (and
    # the state a migration carries, see ModelRunner.generator_state) is the same on CPU and GPU instances.
    race = torch.empty(probs.shape, dtype=probs.dtype)
    for i, generator in enumerate(generators):
        race[i].exponential_(generator=generator or default_generator)
    return first_argmax(probs / race.to(probs.device))


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in ks]
    top = torch.topk(logits, max(ks), dim=-1).values
    kth = top.gather(1, torch.tensor(ks, device=logits.device).unsqueeze(1) - 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass of strictly better tokens already reaches top_p (the best always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p.unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _token_logprobs(row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    chosen = row[token_id]
    rank = int((row > chosen).sum().item()) + 1
    if num_top > 0:
        top = torch.topk(row, num_top)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    else:
        top_ids, top_values = [], []
    return TokenLogprobs(token_id=token_id, logprob=float(chosen.item()), rank=rank, top_ids=top_ids,
                         top_logprobs=top_values)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise index of the first maximum, as argmax gives it: `max(dim)`'s indices are documented the same and its
    CPU kernel is 2.5x faster over [64, 32000] fp32 (1.3 vs 0.5 ms, 2 threads), ~1 % of a batch-64 decode step."""
    return torch.max(x, dim=-1).indices
