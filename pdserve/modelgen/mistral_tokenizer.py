"""Mistral-7B-v0.1's real tokenizer, built offline from the ``mistral-common`` package's SentencePiece model
(32,000-piece BPE, Llama-style ``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2), read with ``sentencepiece`` (no protobuf
needed), with a Mistral-instruct v1 (``[INST] ... [/INST]``) chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .tokenizer_files import (TEXT_OF_MACRO, MissingPackageError, added_tokens_decoder, package_file,
                              write_tokenizer_files)

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
MISTRAL_CHAT_TEMPLATE = (TEXT_OF_MACRO + r"""
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
""").strip()


def mistral_sentencepiece_file() -> Path:
    """Mistral-7B-v0.1's SentencePiece model from the ``mistral-common`` package."""
    return package_file("mistral_common", "mistral-common", "data", "tokenizer.model.v1")


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
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_by_score(processor, vocab),
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


def _merges_by_score(processor: Any, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a mergeable piece into two pieces, ranked as sentencepiece's BPE applies them."""
    merges: list[tuple[str, str, float, int]] = []
    for merged, merged_id in vocab.items():
        if processor.is_control(merged_id) or processor.is_unknown(merged_id) or processor.is_byte(merged_id):
            continue
        score = processor.get_score(merged_id)
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right, score, merged_id))
    # Highest score first; ties (only the two -1e9 whitespace pieces) by piece id, then by the left part's id.
    merges.sort(key=lambda m: (-m[2], m[3], vocab[m[0]]))
    return [(left, right) for left, right, _, _ in merges]


def build_mistral_tokenizer(out_dir: Path | str, *, model_max_length: int = 32768) -> Path:
    """Write Mistral-7B-v0.1's 32,000-token tokenizer with an ``[INST]`` chat template; return `out_dir`."""
    tokenizer = mistral_backend_tokenizer()
    ids = [(tokenizer.token_to_id(token), token, True) for token in MISTRAL_SPECIAL_TOKENS]
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added_tokens_decoder(ids),
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
    return write_tokenizer_files(Path(out_dir), tokenizer, config, MISTRAL_CHAT_TEMPLATE)
