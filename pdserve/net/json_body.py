"""Request bodies as JSON objects, decoded once at the door of every process (instance and gateway).

Whatever a client sends (invalid UTF-8, malformed or absurdly nested JSON, a bare list) ends as a `BodyError`
with a message the client can act on, never as an exception that escapes the route.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Far deeper than any request pdserve accepts needs (chat content parts, tool schemas), and far below the depth
# at which encoding the body again for an upstream leg would exhaust the interpreter's stack.
MAX_JSON_DEPTH = 64


class BodyError(ValueError):
    """A request body that is not a JSON object pdserve can read; the caller answers 400."""


def decode_object(raw: bytes) -> dict[str, Any]:
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BodyError(f"malformed JSON body: {exc}") from None
    except UnicodeDecodeError as exc:
        raise BodyError(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    except RecursionError:
        raise BodyError(f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    if not isinstance(data, dict):
        raise BodyError("the request body must be a JSON object")
    if _too_deep(data):
        raise BodyError(f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep")
    return data


_CONTAINERS = (dict, list)
_CONTAINER_TYPES = frozenset(_CONTAINERS)


def _too_deep(data: dict[str, Any]) -> bool:
    """Iterative; an object or list of scalars (most bodies' top level, token ids) is cleared in one C-level pass
    over the types of its items."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        children = node.values() if isinstance(node, dict) else node
        if _CONTAINER_TYPES.isdisjoint(map(type, children)):
            continue
        stack.extend((child, depth + 1) for child in children if isinstance(child, _CONTAINERS))
    return False
