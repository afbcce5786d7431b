"""Offline generator for tiny Hugging Face-layout decoder models (llama, mistral, qwen2, qwen3).

Weights come from our own seeded initialisation, not from transformers, so the safetensors
bytes are reproducible and do not change when transformers is upgraded. config.json mirrors
what transformers 5.x writes for each model type, plus the legacy top-level `rope_theta` and
`rope_scaling` keys that older readers expect.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors.torch import save_file

from .tokenizer import (
    DEFAULT_VOCAB_SIZE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    build_tokenizer,
    special_token_ids,
    write_json,
)

TOKENIZER_VOCAB_SIZE = DEFAULT_VOCAB_SIZE + len(SPECIAL_TOKENS)

# 0.02 (the usual HF value) leaves tiny tied models so flat that greedy decoding echoes the
# prompt; 0.2 gives peaked, input-dependent logits that make numerical bugs visible in tests.
INITIALIZER_RANGE = 0.2
# Norm weights are 1 + NORM_JITTER * N(0, 1) rather than all ones, so a norm applied to the
# wrong tensor (or not at all) changes the output.
NORM_JITTER = 0.1
RMS_NORM_EPS = 1e-6
ROPE_THETA = 10000.0

DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int


@dataclass(frozen=True)
class ArchSpec:
    architecture: str
    model_type: str
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool


PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        "tiny": Preset(128, 256, 2, 4, 2, 32, TOKENIZER_VOCAB_SIZE, 2048),
        # Vocab padded past the tokenizer size, as real checkpoints often are.
        "h256": Preset(256, 512, 4, 4, 2, 64, 32000, 2048),
        "llama120m": Preset(768, 2048, 12, 12, 4, 64, 32000, 4096),
    }
)

ARCHS: Mapping[str, ArchSpec] = MappingProxyType(
    {
        "llama": ArchSpec(
            "LlamaForCausalLM", "llama", tie_word_embeddings=False, qkv_bias=False, qk_norm=False
        ),
        "mistral": ArchSpec(
            "MistralForCausalLM", "mistral", tie_word_embeddings=False, qkv_bias=False, qk_norm=False
        ),
        "qwen2": ArchSpec(
            "Qwen2ForCausalLM", "qwen2", tie_word_embeddings=True, qkv_bias=True, qk_norm=False
        ),
        "qwen3": ArchSpec(
            "Qwen3ForCausalLM", "qwen3", tie_word_embeddings=True, qkv_bias=False, qk_norm=True
        ),
    }
)


# ----------------------------------------------------------------------------- weights


def layer_parameter_shapes(spec: ArchSpec, preset: Preset, layer: int) -> dict[str, tuple[int, ...]]:
    prefix = f"model.layers.{layer}"
    q_width = preset.num_attention_heads * preset.head_dim
    kv_width = preset.num_key_value_heads * preset.head_dim
    hidden, inter = preset.hidden_size, preset.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}.self_attn.q_proj.weight": (q_width, hidden),
        f"{prefix}.self_attn.k_proj.weight": (kv_width, hidden),
        f"{prefix}.self_attn.v_proj.weight": (kv_width, hidden),
        f"{prefix}.self_attn.o_proj.weight": (hidden, q_width),
        f"{prefix}.mlp.gate_proj.weight": (inter, hidden),
        f"{prefix}.mlp.up_proj.weight": (inter, hidden),
        f"{prefix}.mlp.down_proj.weight": (hidden, inter),
        f"{prefix}.input_layernorm.weight": (hidden,),
        f"{prefix}.post_attention_layernorm.weight": (hidden,),
    }
    if spec.qkv_bias:
        shapes[f"{prefix}.self_attn.q_proj.bias"] = (q_width,)
        shapes[f"{prefix}.self_attn.k_proj.bias"] = (kv_width,)
        shapes[f"{prefix}.self_attn.v_proj.bias"] = (kv_width,)
    if spec.qk_norm:
        shapes[f"{prefix}.self_attn.q_norm.weight"] = (preset.head_dim,)
        shapes[f"{prefix}.self_attn.k_norm.weight"] = (preset.head_dim,)
    return shapes


def parameter_shapes(spec: ArchSpec, preset: Preset) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor, named exactly as the Hugging Face model classes name them."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (preset.vocab_size, preset.hidden_size),
        "model.norm.weight": (preset.hidden_size,),
    }
    for layer in range(preset.num_hidden_layers):
        shapes.update(layer_parameter_shapes(spec, preset, layer))
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (preset.vocab_size, preset.hidden_size)
    return shapes


def is_norm_weight(name: str) -> bool:
    # Covers input/post_attention layernorms, the final model.norm and Qwen3's q_norm/k_norm.
    return name.endswith("norm.weight")


def init_parameter(shape: tuple[int, ...], is_norm: bool, generator: torch.Generator) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=torch.float32)
    if is_norm:
        tensor.normal_(0.0, 1.0, generator=generator).mul_(NORM_JITTER).add_(1.0)
    else:
        tensor.normal_(0.0, INITIALIZER_RANGE, generator=generator)
    return tensor


def generate_weights(
    shapes: Mapping[str, tuple[int, ...]], seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Seeded float32 init over the names in sorted order (so the stream is fixed), then cast."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: init_parameter(shapes[name], is_norm_weight(name), generator).to(dtype)
        for name in sorted(shapes)
    }


# ----------------------------------------------------------------------------- sharding


def shard_file_name(index: int, num_shards: int) -> str:
    return f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def check_num_shards(num_shards: int, num_tensors: int) -> None:
    if not 1 <= num_shards <= num_tensors:
        raise ValueError(
            f"num_shards must be between 1 and {num_tensors} (the tensor count), got {num_shards}"
        )


def partition_into_shards(names: list[str], sizes: Mapping[str, int], num_shards: int) -> list[list[str]]:
    """Split `names` (kept in order) into exactly `num_shards` non-empty, roughly equal-byte groups."""
    check_num_shards(num_shards, len(names))
    target_per_shard = sum(sizes[name] for name in names) / num_shards
    shards: list[list[str]] = [[]]
    written = 0
    for position, name in enumerate(names):
        shards_still_to_open = num_shards - len(shards)
        names_left = len(names) - position
        over_budget = written + sizes[name] > target_per_shard * len(shards)
        # Open the next shard when this one is full, or when every remaining name is needed
        # to keep the remaining shards non-empty.
        if shards[-1] and shards_still_to_open and (over_budget or names_left == shards_still_to_open):
            shards.append([])
        shards[-1].append(name)
        written += sizes[name]
    return shards


def remove_stale_weights(out_dir: Path) -> None:
    # A previous build with a different shard count would otherwise leave files that loaders
    # might pick up instead of (or mixed with) the new ones.
    stale = [out_dir / "model.safetensors", out_dir / "model.safetensors.index.json"]
    stale += out_dir.glob("model-*-of-*.safetensors")
    for path in stale:
        path.unlink(missing_ok=True)


def save_weights(tensors: Mapping[str, torch.Tensor], out_dir: Path, num_shards: int) -> None:
    remove_stale_weights(out_dir)
    if num_shards == 1:
        save_file(dict(tensors), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    sizes = {name: tensor_nbytes(tensor) for name, tensor in tensors.items()}
    weight_map: dict[str, str] = {}
    for index, shard_names in enumerate(partition_into_shards(sorted(tensors), sizes, num_shards)):
        file_name = shard_file_name(index, num_shards)
        shard = {name: tensors[name] for name in shard_names}
        save_file(shard, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in shard_names})
    index_json = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    write_json(out_dir / "model.safetensors.index.json", index_json)


# ----------------------------------------------------------------------------- configs


def rope_parameters(rope_scaling: Mapping[str, Any] | None) -> dict[str, Any]:
    """transformers 5.x style: theta and type always live together in `rope_parameters`."""
    params: dict[str, Any] = {"rope_theta": ROPE_THETA, "rope_type": "default"}
    if rope_scaling:
        params.update(rope_scaling)
        if "type" in rope_scaling and "rope_type" not in rope_scaling:
            params["rope_type"] = rope_scaling["type"]
    return params


def arch_specific_config(spec: ArchSpec, preset: Preset) -> dict[str, Any]:
    """Keys that transformers 5.x emits only for some model types."""
    if spec.model_type == "llama":
        return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    if spec.model_type == "mistral":
        return {"sliding_window": None}
    qwen_keys: dict[str, Any] = {
        "layer_types": ["full_attention"] * preset.num_hidden_layers,
        "max_window_layers": preset.num_hidden_layers,
        "sliding_window": None,
        "use_sliding_window": False,
    }
    if spec.model_type == "qwen3":
        qwen_keys["attention_bias"] = False
    return qwen_keys


def model_config(
    spec: ArchSpec, preset: Preset, dtype: str, rope_scaling: Mapping[str, Any] | None
) -> dict[str, Any]:
    token_ids = special_token_ids()
    config: dict[str, Any] = {
        "architectures": [spec.architecture],
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "dtype": dtype,
        "eos_token_id": token_ids[EOS_TOKEN],
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "hidden_size": preset.hidden_size,
        "initializer_range": INITIALIZER_RANGE,
        "intermediate_size": preset.intermediate_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "model_type": spec.model_type,
        "num_attention_heads": preset.num_attention_heads,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_key_value_heads": preset.num_key_value_heads,
        "pad_token_id": token_ids[PAD_TOKEN],
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": rope_parameters(rope_scaling),
        # Legacy (transformers 4.x / older engines) spellings of the same RoPE settings.
        "rope_scaling": dict(rope_scaling) if rope_scaling else None,
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": preset.vocab_size,
    }
    config.update(arch_specific_config(spec, preset))
    return config


def generation_config() -> dict[str, Any]:
    token_ids = special_token_ids()
    return {"bos_token_id": None, "eos_token_id": token_ids[EOS_TOKEN], "pad_token_id": token_ids[PAD_TOKEN]}


# ----------------------------------------------------------------------------- entry point


def lookup(table: Mapping[str, Any], key: str, what: str) -> Any:
    if key not in table:
        raise ValueError(f"unknown {what} {key!r}; choose from {sorted(table)}")
    return table[key]


def make_text_model(
    arch: str,
    out_dir: Path,
    preset: str = "tiny",
    seed: int = 0,
    num_shards: int = 1,
    dtype: str = "float32",
    rope_scaling: dict[str, Any] | None = None,
) -> Path:
    """Write a randomly initialised HF-layout checkpoint plus tokenizer into `out_dir`; return it.

    Output is byte-identical for identical arguments.
    """
    spec: ArchSpec = lookup(ARCHS, arch, "arch")
    shape_preset: Preset = lookup(PRESETS, preset, "preset")
    torch_dtype: torch.dtype = lookup(DTYPES, dtype, "dtype")
    shapes = parameter_shapes(spec, shape_preset)
    check_num_shards(num_shards, len(shapes))  # before touching the filesystem
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tensors = generate_weights(shapes, seed, torch_dtype)
    save_weights(tensors, out_dir, num_shards)
    write_json(out_dir / "config.json", model_config(spec, shape_preset, dtype, rope_scaling))
    write_json(out_dir / "generation_config.json", generation_config())
    build_tokenizer(out_dir, DEFAULT_VOCAB_SIZE, model_max_length=shape_preset.max_position_embeddings)
    return out_dir
