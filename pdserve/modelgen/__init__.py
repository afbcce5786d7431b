"""Offline generation of tiny test models and their tokenizer (no model hub access needed)."""

from .text_models import make_text_model
from .tokenizer import build_tokenizer

__all__ = ["build_tokenizer", "make_text_model"]
