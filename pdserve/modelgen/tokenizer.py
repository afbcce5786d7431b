"""Offline byte-level BPE tokenizer for the generated test models.

The tokenizer is trained from scratch on a small text corpus shipped with the package, so
test models never need the model hub. Files are written deterministically so that two builds
produce byte-identical output.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
# Order matters: specials are appended after the BPE vocabulary in this order, which fixes their ids.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN)

DEFAULT_VOCAB_SIZE = 4096
DEFAULT_MODEL_MAX_LENGTH = 2048

def chatml_template(image_token: str | None = None) -> str:
    """Qwen-style ChatML. String content is emitted as is; of OpenAI-style content part lists the text parts are
    concatenated (so the template does not crash on multimodal-shaped requests), and with `image_token` each image
    part becomes that one placeholder token."""
    image = f"{{%- elif part['type'] in ('image', 'image_url') %}}{{{{- '{image_token}' }}}}" if image_token else ""
    return (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}"
        "{{- message['content'] }}"
        "{%- elif message['content'] is not none %}"
        "{%- for part in message['content'] %}"
        "{%- if part['type'] == 'text' %}{{- part['text'] }}" + image + "{%- endif %}"
        "{%- endfor %}"
        "{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}"
        "{{- '<|im_start|>assistant\\n' }}"
        "{%- endif %}"
    )


CHAT_TEMPLATE = chatml_template()


def corpus_text() -> str:
    """The packaged training corpus (pdserve/data/corpus.txt)."""
    return resources.files("pdserve").joinpath("data", "corpus.txt").read_text(encoding="utf-8")


def special_token_ids(vocab_size: int = DEFAULT_VOCAB_SIZE) -> dict[str, int]:
    """Ids of the special tokens: they follow the `vocab_size` BPE entries, in SPECIAL_TOKENS order."""
    return {token: vocab_size + offset for offset, token in enumerate(SPECIAL_TOKENS)}


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE in memory; specials are added afterwards so they get the last ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_text().split("\n\n"), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"corpus too small: BPE reached {tokenizer.get_vocab_size()} entries, wanted {vocab_size}"
        )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer, model_max_length: int) -> dict[str, Any]:
    """The tokenizer_config.json contents, written by hand so transformers is not needed to build it."""
    added_tokens_decoder = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_json(path: Path, payload: Any) -> None:
    """Deterministic JSON: sorted keys, fixed indent, trailing newline."""
    text = json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=False)
    path.write_text(text + "\n", encoding="utf-8")


def build_tokenizer(
    out_dir: Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `out_dir`.

    The BPE has `vocab_size` entries; `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` follow as
    ids vocab_size, vocab_size + 1, vocab_size + 2.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size)
    # tokenizers serializes the vocab ordered by id and merges in rank order, so this is stable.
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(tokenizer, model_max_length))
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
