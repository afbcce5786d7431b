"""Registry of model architectures: the ``architectures[0]`` of config.json picks a builder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.models.config import ModelConfigError, architecture_of, parse_text_config, read_config_json
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.loaded import LoadedModel
from pdserve.models.loader import iter_checkpoint, load_text_weights

__all__ = ["MODEL_REGISTRY", "LoadedModel", "load_model"]


Builder = Callable[[Path, dict, torch.dtype, torch.device, int], LoadedModel]


def build_llama_family(model_dir: Path, raw: dict, dtype: torch.dtype, device: torch.device,
                       max_positions: int) -> LoadedModel:
    cfg = parse_text_config(raw)
    weights, _ = load_text_weights(iter_checkpoint(model_dir), cfg, dtype, device)
    return LoadedModel(cfg, LlamaForCausalLM(cfg, weights, dtype, max_positions, device))


def build_llava(model_dir: Path, raw: dict, dtype: torch.dtype, device: torch.device,
                max_positions: int) -> LoadedModel:
    from pdserve.models.llava import build_llava as build  # image processing loads only for a multimodal model

    return build(model_dir, raw, dtype, device, max_positions)


MODEL_REGISTRY: dict[str, Builder] = {
    "LlamaForCausalLM": build_llama_family,
    "MistralForCausalLM": build_llama_family,
    "Qwen2ForCausalLM": build_llama_family,
    "Qwen3ForCausalLM": build_llama_family,
    "LlavaForConditionalGeneration": build_llava,
}


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, max_positions: int) -> LoadedModel:
    raw = read_config_json(model_dir)
    arch = architecture_of(raw)
    builder = MODEL_REGISTRY.get(arch)
    if builder is None:
        raise ModelConfigError(f"unsupported architecture {arch!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}")
    return builder(Path(model_dir), raw, dtype, device, max_positions)
