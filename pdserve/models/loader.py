"""Reading safetensors checkpoints (one file or sharded with an index) into fused, device-ready tensors."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.models.config import ModelConfigError, TextModelConfig

# Checkpoint entries that are derived at run time and safe to ignore.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise ModelConfigError(f"{model_dir} holds no *.safetensors weights (pytorch .bin files are not supported)")
    return found


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def text_weight_key(hf_name: str) -> str | None:
    """Map a Hugging Face causal-LM parameter name to pdserve's key (fused parts keep a part suffix)."""
    if hf_name == "lm_head.weight":
        return "lm_head"
    if not hf_name.startswith("model."):
        return None
    name = hf_name[len("model."):]
    simple = {"embed_tokens.weight": "embed_tokens", "norm.weight": "norm"}
    if name in simple:
        return simple[name]
    if not name.startswith("layers."):
        return None
    _, index, rest = name.split(".", 2)
    parts = {
        "self_attn.q_proj.weight": "qkv#0", "self_attn.k_proj.weight": "qkv#1", "self_attn.v_proj.weight": "qkv#2",
        "self_attn.q_proj.bias": "qkv_bias#0", "self_attn.k_proj.bias": "qkv_bias#1",
        "self_attn.v_proj.bias": "qkv_bias#2",
        "self_attn.o_proj.weight": "o_proj", "mlp.gate_proj.weight": "gate_up#0", "mlp.up_proj.weight": "gate_up#1",
        "mlp.down_proj.weight": "down_proj", "input_layernorm.weight": "input_layernorm",
        "post_attention_layernorm.weight": "post_attention_layernorm",
        "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    }
    key = parts.get(rest)
    return None if key is None else f"layers.{index}.{key}"


def expected_text_keys(cfg: TextModelConfig) -> set[str]:
    per_layer = ["qkv", "o_proj", "gate_up", "down_proj", "input_layernorm", "post_attention_layernorm"]
    if cfg.qkv_bias:
        per_layer.append("qkv_bias")
    if cfg.qk_norm:
        per_layer += ["q_norm", "k_norm"]
    keys = {f"layers.{i}.{k}" for i in range(cfg.num_layers) for k in per_layer} | {"embed_tokens", "norm"}
    if not cfg.tie_word_embeddings:
        keys.add("lm_head")
    return keys


def load_text_weights(named: Iterator[tuple[str, torch.Tensor]], cfg: TextModelConfig, dtype: torch.dtype,
                      device: torch.device, rename: Callable[[str], str | None] = text_weight_key,
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Returns (text weights keyed for LlamaForCausalLM, checkpoint entries the text model did not claim)."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    weights: dict[str, torch.Tensor] = {}
    unclaimed: dict[str, torch.Tensor] = {}
    for hf_name, tensor in named:
        key = rename(hf_name)
        if key is None:
            if not hf_name.endswith(_IGNORED_SUFFIXES):
                unclaimed[hf_name] = tensor
            continue
        if key == "lm_head" and cfg.tie_word_embeddings:
            continue
        tensor = tensor.to(device=device, dtype=dtype)
        if "#" in key:
            base, part = key.split("#")
            parts.setdefault(base, {})[int(part)] = tensor
        else:
            weights[key] = tensor
    for base, pieces in parts.items():
        weights[base] = torch.cat([pieces[i] for i in sorted(pieces)], dim=0)
    missing = expected_text_keys(cfg) - weights.keys()
    if missing:
        raise ModelConfigError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
    return weights, unclaimed
