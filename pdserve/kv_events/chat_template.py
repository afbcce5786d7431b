"""A model's chat template at the gateway: rendered as transformers renders it, by minijinja where that agrees.

The instances render a chat prompt with jinja2 as transformers sets it up (sandboxed, trim_blocks, lstrip_blocks,
loop controls, a `tojson` that keeps non-ASCII text, `raise_exception`). For kv_aware routing the gateway must render
it the same way, once per request, and jinja2 was the largest single part of reading a chat prompt there.
minijinja (the Rust engine the field's gateways render chat templates with) renders the same templates in well
under half the time, but its dialect is not jinja2's in every corner. So a self-test renders varied conversations
(roles, turns, tools, text that looks like markup) with both at startup, and minijinja is used only where every one
agrees, outcome for outcome (a template that raises must raise in both); a render it refuses at run time is done by
jinja2. A difference the self-test did not meet would cost a routing credit, never an answer: each instance renders
its own prompt.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)

_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Zürich, say"}},
                   "required": ["city"]}}}]
_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
# Conversations the two engines must render alike, with and without a generation prompt, with and without tools.
SAMPLES: tuple[list[dict[str, Any]], ...] = (
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!\nHow are you?  "}],
    [{"role": "system", "content": "  {{ not a tag }} {% nor this %} <b>&amp;</b> \"q\" 'q' \\ "},
     {"role": "user", "content": "東京 naïve e\u0301 😀\t\n\n"},
     {"role": "assistant", "content": "Fine."},
     {"role": "user", "content": ""}],
    [{"role": "user", "content": "What is the weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [_CALL]},
     {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "call_1", "name": "get_weather"},
     {"role": "assistant", "content": "21 degrees."}, {"role": "user", "content": "Thanks"}],
    [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "Then me."}],
)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=False)


def _raise_exception(message: str) -> None:
    raise ValueError(message)


class ChatTemplate:
    def __init__(self, source: str, fast: bool = True) -> None:
        """`fast`: use minijinja where the self-test allows (False: jinja2 only)."""
        self.jinja = _jinja(source)
        self.fast = _minijinja(source) if fast else None
        if self.fast is not None and not self._agree():
            log.info("the chat template renders differently in minijinja: the gateway renders it with jinja2")
            self.fast = None

    def render(self, **context: Any) -> str:
        if self.fast is not None:
            try:
                return self.fast.render_template("chat", **context)
            except Exception:  # noqa: BLE001 - jinja2 renders it, or raises what the instance would
                pass
        return self.jinja.render(**context)

    def _agree(self) -> bool:
        for messages in SAMPLES:
            for tools in (None, _TOOLS):
                for generation in (True, False):
                    context = {"messages": messages, "tools": tools, "add_generation_prompt": generation,
                               "bos_token": "<s>", "eos_token": "</s>"}
                    if _outcome(lambda: self.jinja.render(**context)) != \
                            _outcome(lambda: self.fast.render_template("chat", **context)):
                        return False
        return True


def _outcome(render: Any) -> str | None:
    """The text rendered, or None where the template raised."""
    try:
        return render()
    except Exception:  # noqa: BLE001 - a template may refuse a conversation (raise_exception): both must
        return None


def _jinja(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def _minijinja(source: str) -> Any:
    try:
        import minijinja

        env = minijinja.Environment(trim_blocks=True, lstrip_blocks=True)
        env.add_filter("tojson", _tojson)
        env.add_function("raise_exception", _raise_exception)
        env.add_template("chat", source)
    except Exception as exc:  # noqa: BLE001 - not installed, or a syntax it does not read: jinja2 renders
        log.info("minijinja cannot load the chat template (%s): the gateway renders it with jinja2", exc)
        return None
    return env
