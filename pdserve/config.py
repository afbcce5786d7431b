"""Engine configuration: one flat, validated description of an instance (named like `vllm serve`'s flags)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.models.config import (ModelConfigError, ModelSpec, checkpoint_dtype, parse_dtype, read_config_json,
                                   text_config_of)
from pdserve.utils import cdiv

if TYPE_CHECKING:
    import torch

ROLES = ("both", "prefill", "decode", "encode")
ATTENTION_BACKENDS = ("auto", "native", "torch")  # decode attention; see pdserve/native/backend.py
DEFAULT_KV_CACHE_GIB = 1.0


@dataclass(slots=True)
class EngineConfig:
    model: Path
    served_model_name: str | None = None
    tokenizer: Path | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides the memory budget below (vLLM: --num-gpu-blocks-override)
    kv_cache_memory_gib: float = DEFAULT_KV_CACHE_GIB
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    num_threads: int | None = None
    device: str = "cpu"
    attention_backend: str | None = None  # auto | native | torch; None: $PDSERVE_ATTENTION_BACKEND, else auto
    role: str = "both"
    kv_transfer_config: dict[str, Any] = field(default_factory=dict)
    ec_transfer_config: dict[str, Any] = field(default_factory=dict)
    kv_events_config: dict[str, Any] = field(default_factory=dict)  # vLLM's --kv-events-config
    encoder_cache_size: int | None = None  # embeddings; default max(max_num_batched_tokens, 8192)
    allowed_local_media_path: Path | None = None
    allow_remote_media: bool = False

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; choose one of {', '.join(ROLES)}")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}; choose one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")

    @property
    def model_name(self) -> str:
        return self.served_model_name or str(self.model)

    def resolve_model(self) -> ModelSpec:
        """Read the model's config.json, the one time startup does, and resolve dtype and context length."""
        raw = read_config_json(self.model)
        dtype = self.torch_dtype(checkpoint_dtype(raw))
        text = text_config_of(raw)
        return ModelSpec(self.model, raw, text, dtype, self.resolve_max_model_len(text.max_position_embeddings))

    def torch_dtype(self, config_dtype: torch.dtype | None) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return parse_dtype(self.dtype)
        chosen = config_dtype or torch.float32
        if chosen == torch.float16 and self.device == "cpu":
            # fp16 kernels on CPU are slow and inexact; bf16 has the same storage cost (vLLM does this too).
            return torch.bfloat16
        return chosen

    def resolve_max_model_len(self, max_position_embeddings: int) -> int:
        if self.max_model_len is None:
            return max_position_embeddings
        if self.max_model_len > max_position_embeddings:
            raise ModelConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{max_position_embeddings}")
        return self.max_model_len

    def check_kv_capacity(self, max_model_len: int) -> None:
        """A KV cache that cannot hold one sequence of max_model_len tokens is refused, as vLLM refuses it."""
        if self.num_kv_blocks is None or self.role == "encode":
            return
        if self.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be at least 1, got {self.num_kv_blocks}")
        capacity = self.num_kv_blocks * self.block_size
        if capacity < max_model_len:
            raise ValueError(
                f"the model's max seq len ({max_model_len}) is larger than the maximum number of tokens that can be "
                f"stored in the KV cache ({capacity} = {self.num_kv_blocks} blocks of {self.block_size}); raise "
                f"--num-kv-blocks to at least {cdiv(max_model_len, self.block_size)} or lower --max-model-len")

    def resolve_num_blocks(self, block_bytes: int, max_model_len: int) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        if self.role == "encode":  # it runs only the vision encoder: a token KV cache keeps the engine whole
            return cdiv(max_model_len, self.block_size)
        by_memory = int(self.kv_cache_memory_gib * (1 << 30)) // block_bytes
        # Never more than every sequence at full length could use: no point reserving memory nobody can fill.
        by_need = self.max_num_seqs * cdiv(max_model_len, self.block_size)
        return max(min(by_memory, by_need), cdiv(max_model_len, self.block_size))
