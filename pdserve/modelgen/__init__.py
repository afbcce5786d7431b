"""Offline generation of tiny test models and their tokenizer (no model hub access needed).

Exports resolve lazily, so that importing the CLI (which the torch-free gateway shares) does not load torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_tokenizer", "make_text_model"]


def __getattr__(name: str) -> Any:
    if name == "make_text_model":
        from .text_models import make_text_model

        return make_text_model
    if name == "build_tokenizer":
        from .tokenizer import build_tokenizer

        return build_tokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
