"""Offline generator for a tiny LLaVA (CLIP vision tower + projector + Llama), without transformers.

Same principles as text_models.py: our own seeded initialisation over the tensor names in sorted order, so the
files are byte-identical across builds and transformers versions. config.json, processor_config.json and the
tokenizer files are written the way transformers 5.23 writes them for the same model (``LlavaConfig.to_dict``
minus defaults, ``LlavaProcessor.save_pretrained``), so ``LlavaForConditionalGeneration.from_pretrained`` and
``AutoProcessor.from_pretrained`` load the folder as is.

Two weight layouts (the values are identical, only the names differ):

* ``"hf5"``: transformers 5 parameter names: ``model.language_model.*``, ``lm_head.weight``,
  ``model.vision_tower.*``, ``model.multi_modal_projector.*``;
* ``"hub"``: the llava-hf hub names: ``language_model.model.*``, ``language_model.lm_head.weight``,
  ``vision_tower.vision_model.*``, ``multi_modal_projector.*``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer

from .text_models import (
    ARCHS,
    DTYPES,
    INITIALIZER_RANGE,
    NORM_JITTER,
    PRESETS,
    TOKENIZER_VOCAB_SIZE,
    generation_config,
    lookup,
    model_config,
    parameter_shapes,
    save_weights,
)
from .tokenizer import DEFAULT_MODEL_MAX_LENGTH, build_tokenizer, chatml_template, write_json

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = TOKENIZER_VOCAB_SIZE  # the first id after the text tokenizer's specials
VOCAB_SIZE = TOKENIZER_VOCAB_SIZE + 1

VISION_HIDDEN = 64
VISION_INTERMEDIATE = 128
VISION_LAYERS = 2
VISION_HEADS = 4
IMAGE_SIZE = 32
PATCH_SIZE = 8
NUM_PATCHES = (IMAGE_SIZE // PATCH_SIZE) ** 2
NUM_CHANNELS = 3
# "default" drops CLS, so one image token per patch.
IMAGE_SEQ_LENGTH = NUM_PATCHES
# Biases are small but not zero, so a bias that is dropped or applied twice changes the output.
BIAS_STD = 0.05

OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

LAYOUTS = ("hf5", "hub")

# Each image part becomes one <image> placeholder token. Expanding it to IMAGE_SEQ_LENGTH image tokens is not
# the template's job: transformers' LlavaProcessor expands it when tokenizing, and pdserve expands it itself
# after tokenizing (pdserve/multimodal). Otherwise Qwen-style ChatML, as the text models use.
CHAT_TEMPLATE = chatml_template(IMAGE_TOKEN)

_TEXT_PRESET = replace(PRESETS["tiny"], vocab_size=VOCAB_SIZE)
_TEXT_ARCH = ARCHS["llama"]
# Keys text_models writes for standalone causal LMs that transformers 5 does not write inside a text_config.
_NOT_IN_NESTED_TEXT_CONFIG = ("architectures", "dtype", "torch_dtype", "rope_scaling", "rope_theta")

# transformers 5 parameter name prefix -> hub checkpoint prefix.
_HUB_PREFIXES: Mapping[str, str] = MappingProxyType({
    "model.language_model.": "language_model.model.",
    "lm_head.": "language_model.lm_head.",
    "model.vision_tower.": "vision_tower.vision_model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
})


# ----------------------------------------------------------------------------- weights


def vision_layer_shapes(layer: int) -> dict[str, tuple[int, ...]]:
    prefix = f"model.vision_tower.encoder.layers.{layer}"
    hidden, inter = VISION_HIDDEN, VISION_INTERMEDIATE
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}.mlp.fc1.weight": (inter, hidden),
        f"{prefix}.mlp.fc1.bias": (inter,),
        f"{prefix}.mlp.fc2.weight": (hidden, inter),
        f"{prefix}.mlp.fc2.bias": (hidden,),
    }
    for norm in ("layer_norm1", "layer_norm2"):
        shapes[f"{prefix}.{norm}.weight"] = (hidden,)
        shapes[f"{prefix}.{norm}.bias"] = (hidden,)
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        shapes[f"{prefix}.self_attn.{proj}.weight"] = (hidden, hidden)
        shapes[f"{prefix}.self_attn.{proj}.bias"] = (hidden,)
    return shapes


def vision_parameter_shapes() -> dict[str, tuple[int, ...]]:
    prefix = "model.vision_tower"
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}.embeddings.class_embedding": (VISION_HIDDEN,),
        f"{prefix}.embeddings.patch_embedding.weight": (VISION_HIDDEN, NUM_CHANNELS, PATCH_SIZE, PATCH_SIZE),
        f"{prefix}.embeddings.position_embedding.weight": (NUM_PATCHES + 1, VISION_HIDDEN),
    }
    # post_layernorm is unused by LLaVA but part of CLIPVisionModel, so transformers expects it.
    for norm in ("pre_layrnorm", "post_layernorm"):
        shapes[f"{prefix}.{norm}.weight"] = (VISION_HIDDEN,)
        shapes[f"{prefix}.{norm}.bias"] = (VISION_HIDDEN,)
    for layer in range(VISION_LAYERS):
        shapes.update(vision_layer_shapes(layer))
    return shapes


def projector_parameter_shapes() -> dict[str, tuple[int, ...]]:
    text_hidden = _TEXT_PRESET.hidden_size
    prefix = "model.multi_modal_projector"
    return {
        f"{prefix}.linear_1.weight": (text_hidden, VISION_HIDDEN),
        f"{prefix}.linear_1.bias": (text_hidden,),
        f"{prefix}.linear_2.weight": (text_hidden, text_hidden),
        f"{prefix}.linear_2.bias": (text_hidden,),
    }


def text_parameter_shapes() -> dict[str, tuple[int, ...]]:
    """The Llama's causal-LM names (``model.*``, ``lm_head.weight``) moved under ``model.language_model``."""
    shapes = parameter_shapes(_TEXT_ARCH, _TEXT_PRESET)
    return {name if name.startswith("lm_head.") else "model.language_model." + name[len("model."):]: shape
            for name, shape in shapes.items()}


def llava_parameter_shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor, under its transformers 5 parameter name."""
    return {**text_parameter_shapes(), **vision_parameter_shapes(), **projector_parameter_shapes()}


_NORM_WEIGHT = re.compile(r"norm\d*\.weight$")  # RMSNorms, LayerNorms, pre_layrnorm


def init_llava_parameter(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=torch.float32)
    if _NORM_WEIGHT.search(name):
        return tensor.normal_(0.0, 1.0, generator=generator).mul_(NORM_JITTER).add_(1.0)
    std = BIAS_STD if name.endswith(".bias") else INITIALIZER_RANGE
    return tensor.normal_(0.0, std, generator=generator)


def generate_llava_weights(seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded float32 init over the transformers 5 names in sorted order, then cast.

    The order does not depend on the layout, so both layouts hold the same values.
    """
    shapes = llava_parameter_shapes()
    generator = torch.Generator().manual_seed(seed)
    return {name: init_llava_parameter(name, shapes[name], generator).to(dtype) for name in sorted(shapes)}


def checkpoint_name(name: str, layout: str) -> str:
    if layout == "hf5":
        return name
    for hf5_prefix, hub_prefix in _HUB_PREFIXES.items():
        if name.startswith(hf5_prefix):
            return hub_prefix + name[len(hf5_prefix):]
    raise ValueError(f"no hub name for {name!r}")


# ----------------------------------------------------------------------------- configs


def text_config(dtype: str) -> dict[str, Any]:
    config = model_config(_TEXT_ARCH, _TEXT_PRESET, dtype, rope_scaling=None)
    for key in _NOT_IN_NESTED_TEXT_CONFIG:
        config.pop(key)
    return config


def vision_config() -> dict[str, Any]:
    return {
        "attention_dropout": 0.0,
        "hidden_act": "quick_gelu",
        "hidden_size": VISION_HIDDEN,
        "image_size": IMAGE_SIZE,
        "initializer_factor": 1.0,
        "initializer_range": INITIALIZER_RANGE,
        "intermediate_size": VISION_INTERMEDIATE,
        "layer_norm_eps": 1e-5,
        "model_type": "clip_vision_model",
        "num_attention_heads": VISION_HEADS,
        "num_channels": NUM_CHANNELS,
        "num_hidden_layers": VISION_LAYERS,
        "patch_size": PATCH_SIZE,
        "projection_dim": VISION_HIDDEN,
    }


def llava_config(dtype: str) -> dict[str, Any]:
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "dtype": dtype,
        "image_seq_length": IMAGE_SEQ_LENGTH,
        # transformers 5 writes image_token_index and maps image_token_id onto it; newer readers look for
        # image_token_id, so both are written (transformers accepts both).
        "image_token_id": IMAGE_TOKEN_ID,
        "image_token_index": IMAGE_TOKEN_ID,
        "model_type": "llava",
        "multimodal_projector_bias": True,
        "projector_hidden_act": "gelu",
        "text_config": text_config(dtype),
        "tie_word_embeddings": False,
        "vision_config": vision_config(),
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
    }


def image_processor_config() -> dict[str, Any]:
    """CLIPImageProcessor settings at the tower's input size, as transformers 5.23 saves them."""
    return {
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": OPENAI_CLIP_MEAN,
        "image_processor_type": "CLIPImageProcessor",
        "image_std": OPENAI_CLIP_STD,
        "resample": 3,  # PIL bicubic
        "rescale_factor": 1 / 255,
        "size": {"shortest_edge": IMAGE_SIZE},
    }


def processor_config() -> dict[str, Any]:
    """processor_config.json as transformers 5's LlavaProcessor.save_pretrained writes it (image settings
    nested)."""
    return {
        "image_processor": image_processor_config(),
        "image_token": IMAGE_TOKEN,
        "num_additional_image_tokens": 1,  # CLIP's CLS token, which "default" then drops again
        "patch_size": PATCH_SIZE,
        "processor_class": "LlavaProcessor",
        "vision_feature_select_strategy": "default",
    }


# ----------------------------------------------------------------------------- tokenizer


def add_image_token(out_dir: Path) -> None:
    """Append ``<image>`` as a special token to the text tokenizer build_tokenizer wrote, and install the
    multimodal chat template."""
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    if tokenizer.token_to_id(IMAGE_TOKEN) != IMAGE_TOKEN_ID:
        got = tokenizer.token_to_id(IMAGE_TOKEN)
        raise RuntimeError(f"{IMAGE_TOKEN} got id {got}, expected {IMAGE_TOKEN_ID}")
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")

    config = json.loads((out_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"][str(IMAGE_TOKEN_ID)] = {
        "content": IMAGE_TOKEN, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
        "special": True,
    }
    config["chat_template"] = CHAT_TEMPLATE
    config["extra_special_tokens"] = [IMAGE_TOKEN]  # transformers 5's name for additional_special_tokens
    config["processor_class"] = "LlavaProcessor"
    write_json(out_dir / "tokenizer_config.json", config)
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


# ----------------------------------------------------------------------------- entry point


def make_llava_model(out_dir: Path, seed: int = 0, dtype: str = "float32",
                     vision_layout: str = "hf5") -> Path:
    """Write a tiny randomly initialised LLaVA (weights, configs, processor, tokenizer) into `out_dir`.

    `vision_layout` picks the checkpoint names ("hf5" or "hub", see the module docstring); the tensors are the
    same either way. Output is byte-identical for identical arguments.
    """
    torch_dtype: torch.dtype = lookup(DTYPES, dtype, "dtype")
    if vision_layout not in LAYOUTS:
        raise ValueError(f"unknown vision_layout {vision_layout!r}; choose from {list(LAYOUTS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    weights = generate_llava_weights(seed, torch_dtype)
    named = {checkpoint_name(name, vision_layout): tensor for name, tensor in weights.items()}
    save_weights(named, out_dir, num_shards=1)
    write_json(out_dir / "config.json", llava_config(dtype))
    write_json(out_dir / "generation_config.json", generation_config())
    write_json(out_dir / "processor_config.json", processor_config())
    # A flat copy for readers older than transformers 5, which look only here; transformers 5 prefers the
    # nested settings in processor_config.json.
    write_json(out_dir / "preprocessor_config.json",
               {**image_processor_config(), "processor_class": "LlavaProcessor"})
    build_tokenizer(out_dir, model_max_length=DEFAULT_MODEL_MAX_LENGTH)
    add_image_token(out_dir)
    return out_dir
