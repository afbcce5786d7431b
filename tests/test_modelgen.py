"""Tests for the offline tiny-model generator (pdserve.modelgen)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.modelgen import build_tokenizer, make_text_model
from pdserve.modelgen.cli import main as cli_main

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(autouse=True)
def single_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny model per architecture, built once for the module."""
    root = tmp_path_factory.mktemp("models")
    return {arch: make_text_model(arch, root / arch) for arch in ARCHS}


def file_digests(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if path.is_file()
    }


def load_model(model_dir: Path) -> torch.nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def fixed_token_ids(length: int, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (1, length), generator=generator)


# ----------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("arch", ARCHS)
def test_build_is_byte_identical(tmp_path: Path, arch: str) -> None:
    first = file_digests(make_text_model(arch, tmp_path / "a", num_shards=2))
    second = file_digests(make_text_model(arch, tmp_path / "b", num_shards=2))
    assert first == second
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(first)


def test_seed_changes_weights_and_norms_are_jittered(tmp_path: Path) -> None:
    seed0 = checkpoint_tensors(make_text_model("qwen3", tmp_path / "s0", seed=0))
    seed1 = checkpoint_tensors(make_text_model("qwen3", tmp_path / "s1", seed=1))
    assert seed0.keys() == seed1.keys()
    assert not torch.equal(seed0["model.embed_tokens.weight"], seed1["model.embed_tokens.weight"])
    norms = [name for name in seed0 if name.endswith("norm.weight")]
    assert any("q_norm" in name for name in norms)
    for name in norms:
        weight = seed0[name]
        assert not torch.all(weight == 1.0), name
        assert abs(weight.mean().item() - 1.0) < 0.1, name


def test_dtype_is_applied(tmp_path: Path) -> None:
    model_dir = make_text_model("llama", tmp_path / "bf16", dtype="bfloat16")
    assert {t.dtype for t in checkpoint_tensors(model_dir).values()} == {torch.bfloat16}
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"


# ----------------------------------------------------------------------------- transformers compatibility


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_in_transformers_with_our_weights(tiny_models: dict[str, Path], arch: str) -> None:
    model = load_model(tiny_models[arch])
    state = model.state_dict()
    for name, tensor in checkpoint_tensors(tiny_models[arch]).items():
        assert torch.equal(state[name], tensor), f"{name} was not loaded from the checkpoint"
    tied = json.loads((tiny_models[arch] / "config.json").read_text())["tie_word_embeddings"]
    assert tied == (arch in ("qwen2", "qwen3"))
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tied


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_is_not_an_echo(tiny_models: dict[str, Path], arch: str) -> None:
    model = load_model(tiny_models[arch])
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[arch])
    prompt_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(prompt_ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    new_tokens = output[0, prompt_ids.shape[1] :].tolist()
    assert len(new_tokens) == 16
    assert len(set(new_tokens)) >= 8, new_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_are_peaked(tiny_models: dict[str, Path], arch: str) -> None:
    # A clear top-1/top-2 margin keeps greedy decoding stable under small numerical differences.
    model = load_model(tiny_models[arch])
    input_ids = fixed_token_ids(64, model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids).logits[0]
    top2 = logits.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    assert gap.median().item() > 0.05


def test_sharded_checkpoint_matches_single_file(tmp_path: Path) -> None:
    single = make_text_model("qwen2", tmp_path / "single")
    sharded = make_text_model("qwen2", tmp_path / "sharded", num_shards=2)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert index["weight_map"].keys() == checkpoint_tensors(single).keys()
    assert not (sharded / "model.safetensors").exists()

    input_ids = fixed_token_ids(32, 4096)
    with torch.no_grad():
        single_logits = load_model(single)(input_ids).logits
        sharded_logits = load_model(sharded)(input_ids).logits
    assert torch.equal(single_logits, sharded_logits)


def test_rebuild_with_other_shard_count_removes_stale_weights(tmp_path: Path) -> None:
    model_dir = make_text_model("llama", tmp_path / "m", num_shards=3)
    make_text_model("llama", model_dir, num_shards=1)
    assert sorted(path.name for path in model_dir.glob("*.safetensors*")) == ["model.safetensors"]


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        {"rope_type": "linear", "factor": 2.0},
    ],
)
def test_rope_scaling_model_loads(tmp_path: Path, rope_scaling: dict) -> None:
    model_dir = make_text_model("llama", tmp_path / "scaled", rope_scaling=rope_scaling)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_scaling"] == rope_scaling
    assert config["rope_parameters"]["rope_type"] == rope_scaling["rope_type"]

    model = load_model(model_dir)
    assert model.config.rope_parameters["rope_type"] == rope_scaling["rope_type"]
    assert model.config.rope_parameters["factor"] == rope_scaling["factor"]
    assert model.model.rotary_emb.rope_type == rope_scaling["rope_type"]
    with torch.no_grad():
        logits = model(fixed_token_ids(16, 4096)).logits
    assert torch.isfinite(logits).all()


# ----------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out_dir)
    return out_dir


def test_tokenizer_special_tokens(tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    special_ids = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)
    # Specials come right after the 4096 BPE entries.
    assert special_ids == list(range(4096, 4096 + len(SPECIAL_TOKENS)))
    assert len(tokenizer) == 4096 + len(SPECIAL_TOKENS)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.bos_token is None
    for token, token_id in zip(SPECIAL_TOKENS, special_ids):
        assert tokenizer.encode(token) == [token_id]


def test_chat_template_renders_chatml(tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": [{"type": "text", "text": "How are you?"}]},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected_turns = [
        ("system", "You are terse."),
        ("user", "Hello there!"),
        ("assistant", "Hi."),
        ("user", "How are you?"),
    ]
    expected = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in expected_turns)
    assert rendered == expected + "<|im_start|>assistant\n"
    without_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without_prompt == expected
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == (tokenizer_dir / "chat_template.jinja").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "text",
    [
        "Plain ASCII, with punctuation; numbers 12345 and  double  spaces.\n",
        "Français: déjà vu, naïve. Deutsch: Straße, Größe.",
        "中文测试：今天天气很好。日本語もテスト。",
        "Emoji 🚀🎉 and a rare one 🦩, plus a combined flag 🇫🇷.",
    ],
)
def test_tokenizer_round_trips_utf8(tokenizer_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer.encode(text)
    assert all(0 <= i < 4096 for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_build_is_byte_identical(tmp_path: Path) -> None:
    build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")
    assert file_digests(tmp_path / "a") == file_digests(tmp_path / "b")


# ----------------------------------------------------------------------------- CLI


def test_cli_make_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "cli"
    rc = cli_main(["make-model", "--arch", "qwen3", "--shards", "2", "--dtype", "float16", str(out_dir)])
    assert rc == 0
    assert capsys.readouterr().out.strip() == str(out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["dtype"] == "float16"
    assert (out_dir / "model.safetensors.index.json").exists()


def test_cli_rejects_bad_shard_count(tmp_path: Path) -> None:
    out_dir = tmp_path / "bad"
    assert cli_main(["make-model", "--arch", "llama", "--shards", "0", str(out_dir)]) != 0
    assert not out_dir.exists()


def test_cli_choices_match_the_generator():
    """The CLI lists names without importing torch; they must stay in step with what the generator builds."""
    from pdserve.modelgen import cli, llava, text_models

    assert set(cli.TEXT_ARCH_NAMES) == set(text_models.ARCHS)
    assert set(cli.ARCH_NAMES) == set(text_models.ARCHS) | set(cli.MULTIMODAL_ARCH_NAMES)
    assert cli.MULTIMODAL_ARCH_NAMES == ("llava",)
    assert set(cli.LLAVA_LAYOUT_NAMES) == set(llava.LAYOUTS)
    assert set(cli.PRESET_NAMES) == set(text_models.PRESETS)
    assert set(cli.DTYPE_NAMES) == set(text_models.DTYPES)
