"""Registry of model architectures: the ``architectures[0]`` of config.json picks a builder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.models.config import ModelConfigError, ModelSpec, architecture_of, read_config_json, text_config_of
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.loaded import LoadedModel
from pdserve.models.loader import iter_checkpoint, load_text_weights

__all__ = ["MODEL_REGISTRY", "LoadedModel", "build_model", "load_model"]

Builder = Callable[[ModelSpec, torch.device], LoadedModel]


def build_llama_family(spec: ModelSpec, device: torch.device) -> LoadedModel:
    weights, _ = load_text_weights(iter_checkpoint(spec.path), spec.text, spec.dtype, device)
    return LoadedModel(spec.text, LlamaForCausalLM(spec.text, weights, spec.dtype, spec.max_model_len, device))


def build_llava(spec: ModelSpec, device: torch.device) -> LoadedModel:
    from pdserve.models.llava import build_llava as build  # image processing loads only for a multimodal model

    return build(spec, device)


MODEL_REGISTRY: dict[str, Builder] = {
    "LlamaForCausalLM": build_llama_family,
    "MistralForCausalLM": build_llama_family,
    "Qwen2ForCausalLM": build_llama_family,
    "Qwen3ForCausalLM": build_llama_family,
    "LlavaForConditionalGeneration": build_llava,
}


def build_model(spec: ModelSpec, device: torch.device) -> LoadedModel:
    arch = architecture_of(spec.raw)
    builder = MODEL_REGISTRY.get(arch)
    if builder is None:
        raise ModelConfigError(f"unsupported architecture {arch!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}")
    return builder(spec, device)


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, max_positions: int) -> LoadedModel:
    """Read the folder's config and build its model, for callers outside an engine (tests, tools)."""
    raw = read_config_json(model_dir)
    spec = ModelSpec(Path(model_dir), raw, text_config_of(raw), dtype, max_positions)
    return build_model(spec, device)
