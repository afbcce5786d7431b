"""Inference-only CLIP vision tower, numerically matching transformers' ``CLIPVisionModel``.

Only what LLaVA needs: patch + class + position embeddings, ``pre_layrnorm`` and the encoder layers up to the
feature layer LLaVA reads. ``post_layernorm`` (and any layer after the feature layer) never influences LLaVA's
output, so those weights are not kept and those layers are not run (vLLM does the same).

Weights arrive keyed by the ``CLIPVisionModel`` parameter names without any ``vision_model.`` prefix, e.g.
``embeddings.patch_embedding.weight`` or ``encoder.layers.0.self_attn.q_proj.bias``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.layers.linear import Linear
from pdserve.models.config import ModelConfigError

Activation = Callable[[torch.Tensor], torch.Tensor]


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    # Exactly transformers' QuickGELUActivation (the sigmoid approximation original CLIP was trained with).
    return x * torch.sigmoid(1.702 * x)


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: Mapping[str, Activation] = MappingProxyType({
    "gelu": F.gelu,
    "quick_gelu": quick_gelu,
    "gelu_pytorch_tanh": tanh_gelu,
    "gelu_new": tanh_gelu,
})


def activation_fn(name: str) -> Activation:
    if name not in ACTIVATIONS:
        supported = ", ".join(sorted(ACTIVATIONS))
        raise ModelConfigError(f"unsupported activation {name!r}; supported: {supported}")
    return ACTIVATIONS[name]


# CLIPVisionConfig's own defaults, for keys a config.json leaves out.
CLIP_VISION_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
})


@dataclass(frozen=True, slots=True)
class ClipVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> ClipVisionConfig:
        """From a ``vision_config`` dict; missing keys take CLIPVisionConfig's defaults."""
        merged = {**CLIP_VISION_DEFAULTS, **raw}
        config = cls(
            hidden_size=int(merged["hidden_size"]),
            intermediate_size=int(merged["intermediate_size"]),
            num_layers=int(merged["num_hidden_layers"]),
            num_heads=int(merged["num_attention_heads"]),
            num_channels=int(merged["num_channels"]),
            image_size=int(merged["image_size"]),
            patch_size=int(merged["patch_size"]),
            hidden_act=str(merged["hidden_act"]),
            layer_norm_eps=float(merged["layer_norm_eps"]),
        )
        activation_fn(config.hidden_act)  # fail at load time, not at the first image
        if config.hidden_size % config.num_heads:
            raise ModelConfigError(f"vision hidden_size {config.hidden_size} is not a multiple of "
                                   f"num_attention_heads {config.num_heads}")
        return config

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def hidden_state_index(self, feature_layer: int) -> int:
        """Where ``hidden_states[feature_layer]`` is in 0..num_layers; 0 is the input of the first layer, i is
        the output of layer i - 1 (so it is also how many layers must run)."""
        count = self.num_layers + 1
        if not -count <= feature_layer < count:
            raise ModelConfigError(f"vision_feature_layer {feature_layer} is out of range for a vision tower "
                                   f"with {self.num_layers} layers")
        return feature_layer % count


class LayerNorm:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> None:
        self.weight, self.bias, self.eps = weight, bias, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class ClipEncoderLayer:
    """Pre-norm transformer layer: x + attn(ln1(x)), then x + mlp(ln2(x)); q/k/v fused into one GEMM."""

    def __init__(self, cfg: ClipVisionConfig, weights: Mapping[str, torch.Tensor]) -> None:
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.norm1 = LayerNorm(weights["layer_norm1.weight"], weights["layer_norm1.bias"], cfg.layer_norm_eps)
        self.norm2 = LayerNorm(weights["layer_norm2.weight"], weights["layer_norm2.bias"], cfg.layer_norm_eps)
        projections = ("q_proj", "k_proj", "v_proj")
        self.qkv = Linear(torch.cat([weights[f"self_attn.{p}.weight"] for p in projections]),
                          torch.cat([weights[f"self_attn.{p}.bias"] for p in projections]))
        self.out_proj = Linear(weights["self_attn.out_proj.weight"], weights["self_attn.out_proj.bias"])
        self.fc1 = Linear(weights["mlp.fc1.weight"], weights["mlp.fc1.bias"])
        self.fc2 = Linear(weights["mlp.fc2.weight"], weights["mlp.fc2.bias"])
        self.act = activation_fn(cfg.hidden_act)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        qkv = self.qkv(x.reshape(batch * seq, hidden))
        # [batch, seq, 3, heads, head_dim] -> three [batch, heads, seq, head_dim]
        q, k, v = qkv.view(batch, seq, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)  # bidirectional; default scale is head_dim ** -0.5
        return self.out_proj(out.transpose(1, 2).reshape(batch * seq, hidden)).view(batch, seq, hidden)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        out = self.fc2(self.act(self.fc1(x.reshape(batch * seq, hidden))))
        return out.view(batch, seq, hidden)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ClipVisionTower:
    """Computes ``CLIPVisionModel(...).hidden_states[feature_layer]`` and nothing past it."""

    def __init__(self, cfg: ClipVisionConfig, weights: Mapping[str, torch.Tensor],
                 feature_layer: int) -> None:
        self.cfg = cfg
        self.num_layers_to_run = cfg.hidden_state_index(feature_layer)
        self.patch_embedding = weights["embeddings.patch_embedding.weight"]
        self.class_embedding = weights["embeddings.class_embedding"]
        self.position_embedding = weights["embeddings.position_embedding.weight"]
        # "layrnorm" is transformers' spelling.
        self.pre_norm = LayerNorm(weights["pre_layrnorm.weight"], weights["pre_layrnorm.bias"],
                                  cfg.layer_norm_eps)
        self.layers = [ClipEncoderLayer(cfg, layer_weights(weights, i))
                       for i in range(self.num_layers_to_run)]

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = pixel_values.shape
        if height != self.cfg.image_size or width != self.cfg.image_size:
            raise ValueError(f"image is {height}x{width}; this vision tower takes "
                             f"{self.cfg.image_size}x{self.cfg.image_size}")
        patches = F.conv2d(pixel_values.to(self.patch_embedding.dtype), self.patch_embedding,
                           stride=self.cfg.patch_size)
        patches = patches.flatten(2).transpose(1, 2)  # [batch, num_patches, hidden], row-major patch order
        cls = self.class_embedding.expand(batch, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, channels, H, W] -> [n, 1 + num_patches, hidden]; row 0 is the CLS token."""
        hidden = self.pre_norm(self.embed(pixel_values))
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


def layer_weights(weights: Mapping[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    prefix = f"encoder.layers.{index}."
    return {name[len(prefix):]: tensor for name, tensor in weights.items() if name.startswith(prefix)}


def required_vision_keys(num_layers: int) -> set[str]:
    """The tensors a tower running ``num_layers`` layers reads."""
    parts = ("layer_norm1", "layer_norm2", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
    per_layer = [f"{part}.{kind}" for part in parts for kind in ("weight", "bias")]
    keys = {"embeddings.patch_embedding.weight", "embeddings.class_embedding",
            "embeddings.position_embedding.weight", "pre_layrnorm.weight", "pre_layrnorm.bias"}
    return keys | {f"encoder.layers.{i}.{k}" for i in range(num_layers) for k in per_layer}
