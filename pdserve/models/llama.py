"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

q/k/v and gate/up projections are fused into one GEMM each. Qwen2 adds q/k/v biases, Qwen3 a per-head RMSNorm
on q and k before RoPE. Every layer calls the forward context's hooks, which is where KV connectors load a layer
before it is read and save it once it is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.layers.attention import AttentionMetadata, attend_written
from pdserve.layers.linear import Linear, calibrate_linears
from pdserve.layers.pointwise import TORCH_POINTWISE, PointwiseOps, RMSNorm
from pdserve.layers.rotary import RotaryEmbedding
from pdserve.models.config import TextModelConfig


class LayerHooks(Protocol):
    def wait_for_layer_load(self, layer_index: int) -> None: ...

    def save_kv_layer(self, layer_index: int) -> None: ...


class NoHooks:
    def wait_for_layer_load(self, layer_index: int) -> None:
        pass

    def save_kv_layer(self, layer_index: int) -> None:
        pass


@dataclass(slots=True)
class ForwardContext:
    attn: AttentionMetadata
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, kv_heads, block_size, head_dim]
    hooks: LayerHooks
    ops: PointwiseOps = TORCH_POINTWISE  # RMSNorm, residual add, SiLU * mul: plain torch or the engine's fused kernels


class DecoderLayer:
    def __init__(self, cfg: TextModelConfig, weights: dict[str, torch.Tensor], rotary: RotaryEmbedding) -> None:
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.rotary = rotary
        self.input_norm = RMSNorm(weights["input_layernorm"], cfg.rms_norm_eps)
        self.post_attention_norm = RMSNorm(weights["post_attention_layernorm"], cfg.rms_norm_eps)
        self.qkv = Linear(weights["qkv"], weights.get("qkv_bias"))
        self.o_proj = Linear(weights["o_proj"])
        self.gate_up = Linear(weights["gate_up"])
        self.down = Linear(weights["down_proj"])
        self.q_norm = RMSNorm(weights["q_norm"], cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(weights["k_norm"], cfg.rms_norm_eps) if cfg.qk_norm else None
        self.q_size = cfg.num_heads * cfg.head_dim
        self.heads_per_token = cfg.num_heads + 2 * cfg.num_kv_heads
        self.head_split = (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                 layer_cache: torch.Tensor, ctx: ForwardContext,
                 rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it): the residual add is left to the next
        norm, which does it in the same pass (vLLM's layout; the sums are the ones Hugging Face computes).

        With `rows` (the last layer of a step where some rows do not sample) every row's k and v are written, and
        only those rows go on through attention and the MLP: nothing downstream reads the others."""
        ops = ctx.ops
        normed, residual = self.input_norm.with_residual(hidden, residual, ops)
        # One view and one split of the fused projection: q, k and v as per-head views of its output
        # (split_with_sizes is Tensor.split without its Python wrapper).
        heads = self.qkv(normed).view(-1, self.heads_per_token, self.head_dim)
        q, k, v = heads.split_with_sizes(self.head_split, dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary_and_cache(positions, q, k, v, self.rotary.cos, self.rotary.sin, layer_cache, ctx.attn)
        attn = ctx.attn
        if rows is not None:
            assert attn.sampled is not None
            q, residual, attn = q.index_select(0, rows), residual.index_select(0, rows), attn.sampled
            if not len(rows):
                return q.new_empty(0, residual.shape[1]), residual
        attn_out = attend_written(q, k, v, layer_cache, attn, self.scale)
        hidden = self.o_proj(attn_out.reshape(-1, self.q_size))
        normed, residual = self.post_attention_norm.with_residual(hidden, residual, ops)
        return self.down(ops.silu_and_mul(self.gate_up(normed))), residual


class LlamaForCausalLM:
    """Inference-only; weights arrive as a dict of fused, device-ready tensors (see models/loader.py)."""

    def __init__(self, cfg: TextModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_positions: int, device: torch.device) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, dtype, device)
        self.embed_tokens = weights["embed_tokens"]
        self.layers = [DecoderLayer(cfg, weights_of_layer(weights, i), self.rotary) for i in range(cfg.num_layers)]
        self.norm = RMSNorm(weights["norm"], cfg.rms_norm_eps)
        self.lm_head = Linear(weights.get("lm_head", self.embed_tokens))
        calibrate_linears(*zip(*self._linears_and_weights(weights), strict=True))

    def _linears_and_weights(self, weights: dict[str, torch.Tensor]) -> list[tuple[Linear, torch.Tensor]]:
        pairs = [(self.lm_head, weights.get("lm_head", self.embed_tokens))]
        for i, layer in enumerate(self.layers):
            w = weights_of_layer(weights, i)
            pairs += [(layer.qkv, w["qkv"]), (layer.o_proj, w["o_proj"]), (layer.gate_up, w["gate_up"]),
                      (layer.down, w["down_proj"])]
        return pairs

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens.index_select(0, input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, ctx: ForwardContext,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            ctx.hooks.wait_for_layer_load(index)
            rows = ctx.attn.sampled_rows if index == last else None
            hidden, residual = layer(positions, hidden, residual, ctx.kv_cache[:, index], ctx, rows)
            ctx.hooks.save_kv_layer(index)
        return self.norm.with_residual(hidden, residual, ctx.ops)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).to(torch.float32)


def weights_of_layer(weights: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    prefix = f"layers.{index}."
    return {name[len(prefix):]: tensor for name, tensor in weights.items() if name.startswith(prefix)}
