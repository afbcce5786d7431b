"""The instance's OpenAPI document: FastAPI's own, plus the request bodies the OpenAI routes parse themselves.

The routes read their bodies with msgspec and validate them with the models of protocol.py (one parse at the
boundary, errors in OpenAI's shape), so FastAPI cannot see what they accept. Without this, /openapi.json would
describe those routes as taking no body, and schema-driven clients and fuzzers would never send one.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


def describe_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make `app.openapi()` name, for each POST route in `bodies`, the model its JSON body must satisfy."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            modes = [(model, "validation") for model in bodies.values()]
            refs, defs = models_json_schema(modes, ref_template=_REF)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            for path, model in bodies.items():
                content = {"application/json": {"schema": refs[(model, "validation")]}}
                doc["paths"][path]["post"]["requestBody"] = {"required": True, "content": content}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the document
