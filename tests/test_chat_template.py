"""The gateway's chat templates (pdserve/kv_events/chat_template.py) render as transformers renders them, through
minijinja where its self-test allows and jinja2 otherwise: transformers' `apply_chat_template` is the oracle."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from pdserve.kv_events.chat_template import ChatTemplate
from pdserve.modelgen.llava import CHAT_TEMPLATE as LLAVA_TEMPLATE
from pdserve.modelgen.mistral_tokenizer import MISTRAL_CHAT_TEMPLATE
from pdserve.modelgen.qwen_tokenizer import QWEN_CHAT_TEMPLATE
from pdserve.modelgen.tokenizer import CHAT_TEMPLATE

TEMPLATES = {"llama": CHAT_TEMPLATE, "qwen": QWEN_CHAT_TEMPLATE, "mistral": MISTRAL_CHAT_TEMPLATE,
             "llava": LLAVA_TEMPLATE}
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Find \"documents\" <fast>",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string"}, "limit": {"type": "integer"}}}}}]
CONVERSATIONS = [
    [{"role": "system", "content": "Answer in French. Säg hej. \u00a0{# not a comment #}"},
     {"role": "user", "content": "Turn one"}, {"role": "assistant", "content": "Un."},
     {"role": "user", "content": "Turn two"}, {"role": "assistant", "content": "Deux."},
     {"role": "user", "content": "Turn three\r\n"}],
    [{"role": "user", "content": "Find the report", "name": "alice"},
     {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "search", "arguments": {"query": "report", "limit": 3}}}]},
     {"role": "tool", "content": "[\"a.pdf\"]", "tool_call_id": "c1"}],
    [{"role": "user", "content": [{"type": "text", "text": "Parts "}, {"type": "text", "text": "joined"}]}],
    [{"role": "system", "content": "alone"}],
]


def outcome(render: Any) -> str | None:
    """The text rendered, or None where the template refused the conversation."""
    try:
        return render()
    except Exception:  # noqa: BLE001 - transformers raises jinja2's TemplateError, the gateway a ValueError
        return None


def sent(messages: list[dict]) -> list[dict]:
    """As the gateway hands them to the template: fields sent as null left out (transformers renders them empty)."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


@pytest.fixture(scope="module")
def hf(llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(llama_dir))


def renders_like_transformers(template: ChatTemplate, source: str, hf: Any) -> None:
    special = {k: v for k, v in hf.special_tokens_map.items() if isinstance(v, str)}
    rendered = 0
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):
            for generation in (True, False):
                expected = outcome(lambda: hf.apply_chat_template(
                    messages, tools=tools, chat_template=source, add_generation_prompt=generation, tokenize=False))
                got = outcome(lambda: template.render(**special, messages=sent(messages), tools=tools,
                                                      add_generation_prompt=generation))
                assert got == expected, (messages, tools, generation)
                rendered += expected is not None
    assert rendered >= 8  # most conversations render: the comparison is of text, not of two refusals


@pytest.mark.parametrize("name", TEMPLATES)
def test_each_template_renders_through_minijinja_as_transformers_renders_it(name: str, hf: Any) -> None:
    template = ChatTemplate(TEMPLATES[name])
    assert template.fast is not None, "the self-test should find minijinja renders this template as jinja2 does"
    renders_like_transformers(template, TEMPLATES[name], hf)


def test_a_template_minijinja_renders_differently_is_rendered_by_jinja2(hf: Any) -> None:
    # a range printed: "range(0, 2)" in jinja2, a list in minijinja
    source = "{{ range(messages | length) }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    template = ChatTemplate(source)
    assert template.fast is None
    renders_like_transformers(template, source, hf)


def test_a_render_minijinja_refuses_at_run_time_is_done_by_jinja2(hf: Any) -> None:
    # minijinja's wordwrap takes no width: only a role the self-test never sends reaches it
    source = ("{% for m in messages %}{% if m['role'] == 'note' %}{{ m['content'] | wordwrap(8) }}"
              "{% else %}{{ m['role'] }}: {{ m['content'] }}{% endif %}\n{% endfor %}")
    template = ChatTemplate(source)
    assert template.fast is not None
    messages = [{"role": "note", "content": "a note long enough to wrap"}, {"role": "user", "content": "hi"}]
    expected = hf.apply_chat_template(messages, chat_template=source, tokenize=False)
    assert "\n" in expected.split("user:")[0].strip()  # jinja2 wrapped it
    assert template.render(messages=messages, add_generation_prompt=True) == expected


def test_without_minijinja_every_template_renders_through_jinja2(hf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "minijinja", None)  # its import fails, as where it is not installed
    for source in TEMPLATES.values():
        template = ChatTemplate(source)
        assert template.fast is None
        renders_like_transformers(template, source, hf)
