"""The OpenAPI schema the server publishes: FastAPI's, made to say what the server does (400 rather than 422 for
an invalid body, the one model id, the context as max_tokens' bound, server-sent events as the streamed 200 body,
and null accepted for every optional request field)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from moelane.server.protocol import Body

SSE_EVENT = {  # one server-sent event (OpenAPI < 3.2: the schema of a stream's media type is that of each event)
    "type": "object",
    "properties": {"data": {"type": "string", "description": "a JSON chunk, an error body, or [DONE]"},
                   "event": {"type": "string"}},
    "required": ["data"],
}  # fmt: skip


def openapi_schema(app: FastAPI, model_name: str, max_context: int, no_tools: str | None) -> dict[str, Any]:
    """FastAPI's schema, made to say what the server does: 400 (not 422) for invalid bodies, the one model id,
    the context as the bound of max_tokens, no tools where the model takes none (`no_tools` says why), and
    server-sent events as the other 200 body of the generation routes."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path in schema["paths"].values():
        for op in path.values():
            op["responses"].pop("422", None)
            if "requestBody" in op:
                op["responses"]["200"]["content"]["text/event-stream"] = {"schema": SSE_EVENT}
    schemas = schema["components"]["schemas"]
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        props["model"] = {"type": "string", "enum": [model_name], "title": "Model"}
        for key in ("max_tokens", "max_completion_tokens"):
            if key in props:
                props[key]["anyOf"][0]["maximum"] = max_context - 1
    if no_tools is not None:
        tools = schemas["ChatCompletionRequest"]["properties"]["tools"]
        tools["anyOf"][0]["maxItems"] = 0
        tools["description"] = f"none: {no_tools}"
    nullable_optionals(schemas)
    app.openapi_schema = schema
    return schema


def nullable_optionals(schemas: dict[str, Any]) -> None:
    """Say in the schema what `protocol.Body` does: an optional field of a request body takes null as its default
    (OpenAI's schema makes most of them nullable, and clients send null for fields they leave unset)."""
    classes, seen = [Body], set[str]()
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        if (body := schemas.get(cls.__name__)) is None or cls.__name__ in seen:
            continue
        seen.add(cls.__name__)
        required = set(body.get("required", ()))
        for key, prop in body.get("properties", {}).items():
            if key in required or {"type": "null"} in prop.get("anyOf", ()) or prop.get("type") == "null":
                continue
            outer = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
            body["properties"][key] = {"anyOf": [prop, {"type": "null"}], **outer}
