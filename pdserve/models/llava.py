"""LLaVA: a CLIP vision tower, a two-layer projector, and a Llama-family language model.

``LlavaVision.encode`` turns preprocessed images into one text-space embedding per image token; the language
model is pdserve's ``LlamaForCausalLM`` fed ``inputs_embeds`` in which the image-token rows are replaced by
those embeddings (row order = patch order, image after image). Prompt expansion (one ``<image>`` placeholder
into ``num_image_tokens`` image tokens) happens in pdserve, not in the chat template.

Checkpoint layouts accepted, in any mix (each part is recognised on its own):

* hub (llava-hf repos, transformers 4): ``language_model.model.*``, ``language_model.lm_head.weight``,
  ``vision_tower.vision_model.*``, ``multi_modal_projector.*``;
* transformers 5 parameter names (the in-memory state dict): ``model.language_model.*``, ``lm_head.weight``,
  ``model.vision_tower.*``, ``model.multi_modal_projector.*``;
* what transformers 5.23's ``save_pretrained`` writes: the hub names, except the vision tower is
  ``vision_tower.*`` (CLIPVisionModel lost its ``vision_model`` submodule in transformers 5).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from pdserve.layers.linear import Linear
from pdserve.models.clip_vision import (
    ClipVisionConfig,
    ClipVisionTower,
    activation_fn,
    required_vision_keys,
)
from pdserve.models.config import ModelConfigError, ModelSpec
from pdserve.models.image_processor import ClipImageProcessor, load_image_processor
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.loaded import LoadedModel
from pdserve.models.loader import iter_checkpoint, load_text_weights, text_weight_key

# LlavaConfig's defaults for its vision sub-config (llava-1.5's CLIP ViT-L/14-336): hub configs such as
# llava-hf/llava-1.5-7b-hf list only the keys that differ from these (the text part's are filled by text_config_of).
LLAVA_VISION_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14, "image_size": 336,
    "num_hidden_layers": 24, "num_attention_heads": 16,
})

LANGUAGE_MODEL, VISION_TOWER, PROJECTOR = "language_model", "vision_tower", "multi_modal_projector"
# Vision tensors that exist in checkpoints but never affect LLaVA's output.
_UNUSED_VISION_PREFIXES = ("post_layernorm.", "embeddings.position_ids")


@dataclass(frozen=True, slots=True)
class LlavaConfig:
    image_token_id: int
    image_seq_length: int
    vision: ClipVisionConfig
    vision_feature_layer: int
    vision_feature_select_strategy: str  # "default" drops the CLS token, "full" keeps it
    projector_hidden_act: str
    projector_bias: bool

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> LlavaConfig:
        feature_layer = raw.get("vision_feature_layer", -2)
        if not isinstance(feature_layer, int):
            raise ModelConfigError(f"vision_feature_layer {feature_layer!r}: "
                                   "pdserve supports a single layer index")
        strategy = raw.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ModelConfigError(f"unsupported vision_feature_select_strategy {strategy!r}")
        image_token_id = raw.get("image_token_index", raw.get("image_token_id", 32000))
        vision = ClipVisionConfig.from_hf({**LLAVA_VISION_DEFAULTS, **(raw.get("vision_config") or {})})
        config = cls(
            image_token_id=int(image_token_id),
            image_seq_length=int(raw.get("image_seq_length", 576)),
            vision=vision,
            vision_feature_layer=feature_layer,
            vision_feature_select_strategy=strategy,
            projector_hidden_act=str(raw.get("projector_hidden_act", "gelu")),
            projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        )
        vision.hidden_state_index(feature_layer)  # validate now
        activation_fn(config.projector_hidden_act)
        return config

    @property
    def keeps_cls_token(self) -> bool:
        return self.vision_feature_select_strategy == "full"

    @property
    def num_image_tokens(self) -> int:
        """Tokens (and embedding rows) per image: one per patch, plus the CLS token under "full"."""
        return self.vision.num_patches + int(self.keeps_cls_token)


# ----------------------------------------------------------------------------- projector and encoder


class MultiModalProjector:
    """linear_1 -> activation -> linear_2, from vision hidden size to text hidden size."""

    def __init__(self, weights: Mapping[str, torch.Tensor], activation: str) -> None:
        self.linear_1 = Linear(weights["linear_1.weight"], weights.get("linear_1.bias"))
        self.linear_2 = Linear(weights["linear_2.weight"], weights.get("linear_2.bias"))
        self.act = activation_fn(activation)

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """[rows, vision_hidden] -> [rows, text_hidden]."""
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaVision:
    """The image side of LLaVA: preprocessing settings, vision tower, feature selection and projector."""

    def __init__(self, config: LlavaConfig, tower: ClipVisionTower, projector: MultiModalProjector,
                 image_processor: ClipImageProcessor, dtype: torch.dtype) -> None:
        self.config = config
        self.tower = tower
        self.projector = projector
        self.image_processor = image_processor
        self.dtype = dtype

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    @property
    def image_seq_length(self) -> int:
        return self.config.image_seq_length

    @property
    def vision_config(self) -> ClipVisionConfig:
        return self.config.vision

    @property
    def num_image_tokens(self) -> int:
        return self.config.num_image_tokens

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] preprocessed images -> [n, num_image_tokens, text_hidden] in the model dtype."""
        hidden = self.tower(pixel_values.to(self.dtype))
        if not self.config.keeps_cls_token:
            hidden = hidden[:, 1:]
        n, rows, width = hidden.shape
        return self.projector(hidden.reshape(n * rows, width)).view(n, rows, -1)


# ----------------------------------------------------------------------------- checkpoint keys


def split_llava_key(name: str) -> tuple[str, str] | None:
    """(part, name inside the part) for any accepted layout, or None for a tensor LLaVA does not have.

    Language-model names come back in causal-LM form (``model.layers.0...``, ``lm_head.weight``) so the text
    loader's own mapping applies; vision names in ``CLIPVisionModel`` form without ``vision_model.``.
    """
    if name == "lm_head.weight":
        return LANGUAGE_MODEL, name
    if name.startswith("model."):
        name = name[len("model."):]
    for part in (LANGUAGE_MODEL, VISION_TOWER, PROJECTOR):
        if name.startswith(part + "."):
            return part, _normalize_inner_name(part, name[len(part) + 1:])
    return None


def _normalize_inner_name(part: str, inner: str) -> str:
    if part == LANGUAGE_MODEL:
        is_causal_lm_name = inner.startswith("model.") or inner == "lm_head.weight"  # hub layout
        return inner if is_causal_lm_name else "model." + inner
    if part == VISION_TOWER and inner.startswith("vision_model."):
        return inner[len("vision_model."):]
    return inner


def llava_text_weight_key(name: str) -> str | None:
    """``rename`` for load_text_weights: pdserve's text key of a LLaVA language-model tensor, else None."""
    split = split_llava_key(name)
    if split is None or split[0] != LANGUAGE_MODEL:
        return None
    return text_weight_key(split[1])


def split_vision_weights(unclaimed: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(vision tower weights, projector weights) from what the text loader left, cast and placed."""
    parts: dict[str, dict[str, torch.Tensor]] = {VISION_TOWER: {}, PROJECTOR: {}}
    unknown: list[str] = []
    for name, tensor in unclaimed.items():
        split = split_llava_key(name)
        if split is None or split[0] == LANGUAGE_MODEL:
            unknown.append(name)
        elif not split[1].startswith(_UNUSED_VISION_PREFIXES):
            parts[split[0]][split[1]] = tensor.to(device=device, dtype=dtype)
    if unknown:
        raise ModelConfigError(f"checkpoint has {len(unknown)} tensors LLaVA does not use, "
                               f"e.g. {sorted(unknown)[:5]}")
    return parts[VISION_TOWER], parts[PROJECTOR]


def check_vision_weights(config: LlavaConfig, tower: Mapping[str, torch.Tensor],
                         projector: Mapping[str, torch.Tensor]) -> None:
    needed_layers = config.vision.hidden_state_index(config.vision_feature_layer)
    missing = sorted(required_vision_keys(needed_layers) - tower.keys())
    projector_keys = {"linear_1.weight", "linear_2.weight"}
    if config.projector_bias:
        projector_keys |= {"linear_1.bias", "linear_2.bias"}
    missing += sorted(f"{PROJECTOR}.{k}" for k in projector_keys - projector.keys())
    if missing:
        raise ModelConfigError(f"checkpoint is missing {len(missing)} vision tensors, e.g. {missing[:5]}")


# ----------------------------------------------------------------------------- builder


def load_llava_image_processor(model_dir: Path, raw_config: Mapping[str, Any]) -> ClipImageProcessor:
    """The folder's image processor; without processor files, CLIP's defaults at the tower's input size."""
    config = LlavaConfig.from_hf(raw_config)
    return load_image_processor(model_dir, fallback_image_size=config.vision.image_size)


def build_llava(spec: ModelSpec, device: torch.device) -> LoadedModel:
    config = LlavaConfig.from_hf(spec.raw)
    text_cfg, dtype = spec.text, spec.dtype
    if not 0 <= config.image_token_id < text_cfg.vocab_size:
        raise ModelConfigError(f"image token id {config.image_token_id} is outside the text vocabulary "
                               f"({text_cfg.vocab_size} tokens)")
    text_weights, unclaimed = load_text_weights(iter_checkpoint(spec.path), text_cfg, dtype, device,
                                                rename=llava_text_weight_key)
    tower_weights, projector_weights = split_vision_weights(unclaimed, dtype, device)
    check_vision_weights(config, tower_weights, projector_weights)
    vision = LlavaVision(
        config,
        ClipVisionTower(config.vision, tower_weights, config.vision_feature_layer),
        MultiModalProjector(projector_weights, config.projector_hidden_act),
        load_llava_image_processor(spec.path, spec.raw),
        dtype,
    )
    model = LlamaForCausalLM(text_cfg, text_weights, dtype, spec.max_model_len, device)
    return LoadedModel(text_cfg, model, vision=vision)
