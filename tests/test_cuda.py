"""pdserve's engine on a GPU against transformers on the same GPU: greedy tokens and logprobs in fp32, chunked
prefill, prefix-cache hits, batched decodes, seeded sampling, bf16, and every KV block back in the pool.

The device is `cuda` where torch sees one; elsewhere the device tests skip, unless PDSERVE_TEST_DEVICE names a device
to run them on (`PDSERVE_TEST_DEVICE=cpu` runs the same checks on the CPU, which is how they were written without a
GPU). The oracle is transformers' own model of the same checkpoint, on the same device, in the same dtype. The
comparison is tests/test_oracle.py's: tokens and logprobs (within LOGPROB_TOL) until the reference's first near
tie, after which two correct implementations may diverge.

bf16: the two implementations round differently (pdserve fuses q/k/v and gate/up into one GEMM each; its attention
is SDPA over a gathered paged cache), so, as on the CPU, only the first token is held exactly and its logprob within
0.1, and the continuations must agree for at least half of the tokens compared in all (they share a prefix of that
many tokens); a bf16 engine whose KV cache or weights were wrong diverges at once.

Plain checks that need no device (the per-step metadata moving whole to a device, a KV cache refused on the wrong
device) run everywhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import assert_no_blocks_in_use, random_prompt
from test_oracle import CHUNK_BUDGET, NUM_TOKENS, bf16_agreement, compare_with_oracle, greedy_params
from transformers import GenerationConfig

from pdserve.layers.attention import AttentionMetadata, PrefillChunk
from pdserve.modelgen import make_text_model
from pdserve.sampling_params import SamplingParams


def chosen_device() -> str | None:
    """The device the engine tests run on: $PDSERVE_TEST_DEVICE, else cuda when there is one, else None."""
    return os.environ.get("PDSERVE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)


DEVICE = chosen_device()
needs_device = pytest.mark.skipif(DEVICE is None, reason="no CUDA device (torch.cuda.is_available() is false); "
                                                         "PDSERVE_TEST_DEVICE=cpu runs these checks on the CPU")


@pytest.fixture(scope="module")
def hf_on_device():
    """transformers' model of a folder, on DEVICE, loaded once per (folder, dtype)."""
    from transformers import AutoModelForCausalLM

    cache: dict[tuple[str, torch.dtype], torch.nn.Module] = {}

    def load(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        key = (str(model_dir), dtype)
        if key not in cache:
            cache[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(DEVICE).eval()
        return cache[key]

    yield load
    cache.clear()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def hf_greedy(hf: torch.nn.Module, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """As test_oracle.hf_greedy, with the prompt on the model's device; log-softmaxes come back to the host."""
    config = GenerationConfig(max_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt], device=DEVICE), generation_config=config)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(step[0].double(), dim=-1).cpu() for step in out.logits]


def device_llm(make_llm, model_dir: Path, **kwargs):
    llm = make_llm(model_dir, device=DEVICE, max_num_batched_tokens=CHUNK_BUDGET, **kwargs)
    runner = llm.engine.runner
    assert runner.kv_cache.device.type == torch.device(DEVICE).type
    assert runner.model.embed_tokens.device.type == torch.device(DEVICE).type
    if DEVICE != "cpu":
        assert runner.decode_kernel is None, "the native kernels are CPU-only; a GPU engine takes plain torch"
    return llm


def check_each(llm, hf, prompts: list[list[int]], what: str, num_tokens: int = NUM_TOKENS) -> int:
    results = llm.generate(prompts, greedy_params(num_tokens))  # one call: their decodes run batched
    compared = 0
    for prompt, result in zip(prompts, results, strict=True):
        ref_tokens, ref_logprobs = hf_greedy(hf, prompt, num_tokens)
        compared += compare_with_oracle(result.outputs[0], ref_tokens, ref_logprobs, f"{what} len {len(prompt)}")
    return compared


@needs_device
def test_fp32_greedy_matches_transformers_one_at_a_time(models, make_llm, hf_on_device):
    """1 token to 150 (chunked at 64): prefill alone, in chunks, and decodes at batch 1."""
    model_dir = models("llama")
    llm, hf = device_llm(make_llm, model_dir), hf_on_device(model_dir)
    compared = 0
    for n in (1, 7, 16, 32, 75, 150):
        compared += check_each(llm, hf, [random_prompt(n, seed=n)], f"{DEVICE} fp32")
    assert compared >= 6 * NUM_TOKENS // 2
    assert_no_blocks_in_use(llm.engine)


@needs_device
def test_fp32_batched_decodes_match_transformers(models, make_llm, hf_on_device):
    """Four requests at once: their prefills share steps, their decodes run as one padded batch."""
    model_dir = models("llama")
    llm, hf = device_llm(make_llm, model_dir), hf_on_device(model_dir)
    prompts = [random_prompt(n, seed=700 + n) for n in (3, 20, 47, 90)]
    assert check_each(llm, hf, prompts, f"{DEVICE} fp32 batch") >= 2 * NUM_TOKENS
    assert_no_blocks_in_use(llm.engine)


@needs_device
def test_prefix_cache_hit_matches_transformers(models, make_llm, hf_on_device):
    """A second prompt sharing 80 tokens (5 blocks) takes them from the cache and still matches; an aborted
    request gives its blocks back."""
    model_dir = models("llama")
    llm, hf = device_llm(make_llm, model_dir), hf_on_device(model_dir)
    shared = random_prompt(80, seed=800)
    first, second = shared + random_prompt(10, seed=801), shared + random_prompt(70, seed=802)
    assert check_each(llm, hf, [first], f"{DEVICE} prefix first") >= 1
    (result,) = llm.generate([second], greedy_params())
    assert result.num_cached_tokens == 80, f"expected a 5-block prefix hit, got {result.num_cached_tokens} tokens"
    assert llm.engine.kv.prefix_hits >= 80
    ref_tokens, ref_logprobs = hf_greedy(hf, second, NUM_TOKENS)
    assert compare_with_oracle(result.outputs[0], ref_tokens, ref_logprobs, f"{DEVICE} prefix hit") >= 1

    engine = llm.engine
    rid = engine.add_request("aborted", second + [5], SamplingParams(temperature=0.0, max_tokens=50))
    for _ in range(4):
        engine.step()
    assert engine.kv.num_used_blocks > 0
    engine.abort_request(rid)
    assert_no_blocks_in_use(engine)


@needs_device
def test_seeded_sampling_runs_and_repeats(models, make_llm):
    """Random sampling with every filter and penalty: the same seed gives the same tokens (the race is drawn on
    the host from the request's own generator), and a request without a seed still samples."""
    llm = device_llm(make_llm, models("llama"))
    prompt = random_prompt(40, seed=900)
    params = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.2, frequency_penalty=0.3,
                  presence_penalty=0.2, max_tokens=16, ignore_eos=True, logprobs=2)
    runs = [llm.generate([prompt], SamplingParams(seed=7, **params))[0].outputs[0] for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 16
    unseeded = llm.generate([prompt, prompt], SamplingParams(**params))
    assert all(len(r.outputs[0].token_ids) == 16 for r in unseeded)
    assert_no_blocks_in_use(llm.engine)


@needs_device
def test_bf16_runs_and_roughly_agrees_with_transformers(models, make_llm, hf_on_device):
    model_dir = models("llama")
    llm = device_llm(make_llm, model_dir, dtype="bfloat16")
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16
    hf = hf_on_device(model_dir, torch.bfloat16)
    lengths = (7, 90, 150)
    agree, total = bf16_agreement(llm, hf, lengths, reference=hf_greedy), 8 * len(lengths)
    assert agree >= total // 2, f"bf16 greedy continuations share only {agree} of {total} tokens with transformers"
    assert_no_blocks_in_use(llm.engine)


@pytest.fixture(scope="module")
def llama120m(tmp_path_factory) -> Path:
    """$PDSERVE_LLAMA120M when scripts/gpu_check.sh made the model already, else made here."""
    made = os.environ.get("PDSERVE_LLAMA120M")
    if made:
        return Path(made)
    return make_text_model("llama", tmp_path_factory.mktemp("llama120m"), preset="llama120m")


@needs_device
@pytest.mark.skipif(DEVICE == "cpu" and not os.environ.get("PDSERVE_TEST_120M"),
                    reason="the 120M-parameter model is slow on a CPU; PDSERVE_TEST_120M=1 runs it")
def test_llama120m_fp32_matches_transformers(llama120m, make_llm, hf_on_device):
    """A real-sized shape (12 layers, GQA 3, vocab 32000) over longer prompts, chunked at 64 tokens."""
    llm = device_llm(make_llm, llama120m, max_model_len=1024)
    hf = hf_on_device(llama120m)
    prompts = [random_prompt(n, seed=1200 + n) for n in (5, 130, 600)]
    compared = sum(check_each(llm, hf, [p], f"{DEVICE} 120m fp32", 16) for p in prompts)
    assert compared >= len(prompts), "no step compared"
    assert_no_blocks_in_use(llm.engine)


# -- no device needed -------------------------------------------------------------------------------------------
def test_metadata_moves_every_tensor_to_the_device():
    """Every tensor of a step's metadata, the prefill chunks' block tables and the sampled rows' view included,
    reaches the device (meta here): a field left on the host would fail the first GPU step."""
    def meta() -> AttentionMetadata:
        ids = torch.arange(4)
        return AttentionMetadata(slot_block=ids, slot_offset=ids, num_decode_tokens=1, decode_block_table=ids,
                                 decode_bias=torch.zeros(4), decode_lengths=ids,
                                 prefills=[PrefillChunk(1, 4, 2, ids)], prefill_spans=ids, prefill_tables=ids,
                                 sampled_rows=ids)

    host = meta()
    host.sampled = meta()
    moved = host.to(torch.device("meta"))
    for m in (moved, moved.sampled):
        for name in AttentionMetadata.__slots__:
            value = getattr(m, name)
            if isinstance(value, torch.Tensor):
                assert value.device.type == "meta", name
        assert [c.block_ids.device.type for c in m.prefills] == ["meta"]
        assert (m.num_decode_tokens, m.prefills[0].start, m.prefills[0].num_context_tokens) == (1, 1, 2)
    assert host.slot_block.device.type == "cpu", "the host metadata is left as it was"


def test_a_kv_cache_on_another_device_is_refused(models):
    from pdserve.config import EngineConfig
    from pdserve.engine.model_runner import ModelRunner

    spec = EngineConfig(model=models("llama"), max_model_len=64).resolve_model()
    runner = ModelRunner(spec, block_size=16, attention_backend="torch")
    with pytest.raises(ValueError, match="allocated on meta but the model runs on cpu"):
        runner.allocate_kv_cache(4, lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta"))
    assert runner.allocate_kv_cache(4).device.type == "cpu"
