"""Reading a Hugging Face ``config.json`` into the few numbers the engine needs."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class ModelConfigError(ValueError):
    """A model folder pdserve cannot serve, with a message that says why."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True, slots=True)
class TextModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: torch.dtype | None
    hidden_act: str = "silu"
    extra: dict[str, Any] = field(default_factory=dict)


# The decoder families pdserve implements, and what distinguishes them.
_TEXT_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}
_MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def supported_architectures() -> list[str]:
    """Every architecture the model registry builds (a test keeps the two lists equal). Listed here, not read
    from the registry, so that parsing a config never imports the model code."""
    return sorted((*_TEXT_ARCHITECTURES, *_MULTIMODAL_ARCHITECTURES))


def read_config_json(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{model_dir} has no config.json; expected a Hugging Face model folder")
    return json.loads(path.read_text())


def architecture_of(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs:
        raise ModelConfigError("config.json names no 'architectures'; supported: " + ", ".join(supported_architectures()))
    return archs[0]


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    import torch  # here, not at module import: the gateway reads configs too and must stay torch-free
    table = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if name not in table:
        raise ModelConfigError(f"unsupported dtype {name!r}; use one of float32, bfloat16, float16")
    return table[name]


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes rope_parameters; older configs write rope_theta plus an optional rope_scaling.
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


_ARCH_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "qwen3": "Qwen3ForCausalLM"}


# LlamaConfig's defaults, filled into a multimodal model's llama ``text_config``: hub configs such as
# llava-hf/llava-1.5-7b-hf list only the keys that differ from these.
_LLAMA_TEXT_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
})


def text_config_of(raw: dict[str, Any]) -> TextModelConfig:
    """The language model's config, for causal LMs and for multimodal models (their `text_config`)."""
    text = raw.get("text_config")
    if text is None and architecture_of(raw) not in _MULTIMODAL_ARCHITECTURES:
        return parse_text_config(raw)
    text = dict(text or {})
    if text.get("model_type", "llama") == "llama":
        text = {**_LLAMA_TEXT_DEFAULTS, **text}
    model_type = text.get("model_type", "llama")
    arch = (text.get("architectures") or [None])[0] or _ARCH_OF_MODEL_TYPE.get(model_type)
    if arch is None:
        raise ModelConfigError(f"unsupported text model type {model_type!r} inside {architecture_of(raw)}")
    return parse_text_config(text, arch)


def checkpoint_dtype(raw: dict[str, Any]) -> torch.dtype | None:
    """The dtype the checkpoint was saved in (a multimodal model's text part first), if the config says."""
    for section in (raw.get("text_config") or {}, raw):
        name = section.get("dtype") or section.get("torch_dtype")
        if name:
            return parse_dtype(name)
    return None


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model folder's config.json read once at startup and resolved against the engine's flags. Everything
    built at startup (connectors, engine, model) takes this instead of reading the file again, so they cannot
    disagree on the dtype or the context length."""

    path: Path
    raw: dict[str, Any]
    text: TextModelConfig
    dtype: torch.dtype
    max_model_len: int


def parse_text_config(raw: dict[str, Any], architecture: str | None = None) -> TextModelConfig:
    """Parse the language-model part of a config (a whole causal-LM config, or a multimodal text_config)."""
    architecture = architecture or architecture_of(raw)
    traits = _TEXT_ARCHITECTURES.get(architecture)
    if traits is None:
        raise ModelConfigError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelConfigError(f"unsupported hidden_act {act!r}; pdserve implements silu (SwiGLU) MLPs")
    qkv_bias = bool(raw.get("attention_bias", traits["qkv_bias"])) or traits["qkv_bias"]
    return TextModelConfig(
        architecture=architecture,
        model_type=raw.get("model_type", ""),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rope=_parse_rope(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=traits["qk_norm"],
        eos_token_ids=_eos_ids(raw),
        torch_dtype=parse_dtype(raw.get("dtype") or raw.get("torch_dtype")),
        hidden_act=act,
    )
