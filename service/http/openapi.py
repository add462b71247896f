"""The pod's OpenAPI 3.1 description, built from data and served at `GET /openapi.json`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cachestore.keys import SESSION_ID_PATTERN
from service.http.params import MAX_N, MAX_STOP, MAX_TOP_LOGPROBS
from service.http.requests import MAX_MESSAGES, ROLES

if TYPE_CHECKING:
    from service.state import PodState

SESSION_ID = {"type": "string", "pattern": SESSION_ID_PATTERN, "minLength": 1, "maxLength": 128}
_ROLE = {"type": "string", "enum": list(ROLES)}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {"role": _ROLE, "content": {"oneOf": [{"type": "string"}, {"type": "null"},
                                                        {"type": "array", "items": _TEXT_PART}]},
                   "tool_calls": {"type": "array", "items": {"type": "object"}},
                   "tool_call_id": {"type": "string"}, "name": {"type": "string"}},
}
_MESSAGES = {"type": "array", "items": {"$ref": "#/components/schemas/Message"}, "maxItems": MAX_MESSAGES}
_SAMPLING: dict[str, Any] = {
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "repetition_penalty": {"type": "number", "minimum": 0.01, "maximum": 10},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "logprobs": {"type": ["boolean", "integer"]},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
    "response_format": {"type": "object", "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}}},
    "tools": {"type": "array", "items": {"type": "object"}},
    "tool_choice": {"oneOf": [{"enum": ["none", "auto"]}]},
    "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "maxItems": MAX_STOP,
                                             "items": {"type": "string", "minLength": 1}}]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
}
ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
SESSION = {
    "type": "object", "required": ["id", "object", "messages", "version"],
    "properties": {"id": SESSION_ID, "object": {"const": "session"}, "model": {"type": "string"},
                   "messages": {"type": "array", "items": {"type": "object"}}, "tokens": {"type": "integer"},
                   "version": {"type": "integer"}, "created_at": {"type": "number"},
                   "updated_at": {"type": "number"}},
}
COMPLETION = {"type": "object", "required": ["id", "object", "choices"],
              "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                             "choices": {"type": "array"}, "usage": {"type": "object"}}}

_ERROR_STATUSES = {
    "400": "invalid input", "401": "missing or unknown API key", "404": "no such model or session",
    "409": "conflict (session exists, or changed by another request)", "413": "body too large",
    "501": "this pod runs without a cache", "503": "overloaded, loading, or Redis unavailable",
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _op(summary: str, ok: str, ok_schema: dict[str, Any] | None, errors: tuple[str, ...],
        body: dict[str, Any] | None = None, body_required: bool = True, ok_type: str = "application/json",
        path_id: bool = False) -> dict[str, Any]:
    responses: dict[str, Any] = {ok: {"description": "success"}}
    if ok_schema is not None:
        responses[ok]["content"] = {ok_type: {"schema": ok_schema}}
    for status in errors:
        responses[status] = {"description": _ERROR_STATUSES[status], **_json(_ref("Error"))}
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {"required": body_required, **_json(body)}
    if path_id:
        op["parameters"] = [{"name": "session_id", "in": "path", "required": True, "schema": SESSION_ID}]
    return op


def build_schema(model: str | None = None, title: str = "kvstash pod") -> dict[str, Any]:
    """The whole API: completions, server-side sessions, health and metrics; `model` names the one served."""
    model_schema: dict[str, Any] = {"type": "string", "minLength": 1} if model is None else {"enum": [model]}
    chat_body = {"type": "object", "required": ["model", "messages"], "properties": {
        "model": model_schema, "messages": {**_MESSAGES, "minItems": 1},
        "session_id": SESSION_ID, **_SAMPLING}}
    text_body = {"type": "object", "required": ["model", "prompt"], "properties": {
        "model": model_schema, "prompt": {"type": "string", "minLength": 1},
        "session_id": SESSION_ID, **_SAMPLING}}
    create_body = {"type": "object", "properties": {"session_id": SESSION_ID, "messages": _MESSAGES}}
    turn_body = {"type": "object", "properties": {
        "messages": {**_MESSAGES, "minItems": 1}, "content": {"type": "string"}, "model": model_schema,
        **_SAMPLING}}
    fork_body = {"type": "object", "properties": {"session_id": SESSION_ID}}
    gen_errors = ("400", "401", "404", "413", "503")
    paths = {
        "/healthz": {"get": _op("liveness", "200", {"type": "object"}, ())},
        "/readyz": {"get": _op("readiness (model loaded, not draining after SIGTERM; Redis state reported)", "200",
                               {"type": "object"}, ("503",))},
        "/metrics": {"get": _op("Prometheus metrics", "200", {"type": "string"}, (), ok_type="text/plain")},
        "/openapi.json": {"get": _op("this description", "200", {"type": "object"}, ())},
        "/v1/models": {"get": _op("the model this pod serves", "200", {"type": "object"}, ("401",))},
        "/v1/chat/completions": {"post": _op("chat completion (JSON or SSE stream)", "200", _ref("Completion"),
                                             gen_errors, chat_body)},
        "/v1/completions": {"post": _op("text completion", "200", _ref("Completion"), gen_errors, text_body)},
        "/v1/sessions": {
            "post": _op("create a session", "201", _ref("Session"), ("400", "401", "409", "413", "501", "503"),
                        create_body, body_required=False),
            "get": _op("list the caller's sessions", "200", {"type": "object"}, ("401", "501", "503")),
        },
        "/v1/sessions/{session_id}": {
            "get": _op("read a session", "200", _ref("Session"), ("400", "401", "404", "501", "503"),
                       path_id=True),
            "delete": _op("delete a session", "200", {"type": "object"}, ("400", "401", "404", "501"),
                          path_id=True),
        },
        "/v1/sessions/{session_id}/messages": {
            "post": _op("add a turn and generate the reply", "200", _ref("Completion"),
                        ("400", "401", "404", "409", "413", "501", "503"), turn_body, path_id=True),
        },
        "/v1/sessions/{session_id}/fork": {
            "post": _op("fork a session under a new id", "201", _ref("Session"),
                        ("400", "401", "404", "409", "413", "501", "503"), fork_body, body_required=False,
                        path_id=True),
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1",
                 "description": "OpenAI-compatible completions with a shared KV cache in Redis."},
        "paths": paths,
        "components": {
            "schemas": {"Message": MESSAGE, "Error": ERROR, "Session": SESSION, "Completion": COMPLETION},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}},
        },
        "security": [{}, {"bearer": []}, {"apiKey": []}],
    }


_BUILT: dict[str | None, dict[str, Any]] = {}


async def openapi_json(request: Request) -> Response:
    state: PodState = request.app.state.pod  # set before the first request (service.app), as RouteMetrics reads it
    name = state.engine.name if state.engine is not None else None
    if name not in _BUILT:
        _BUILT[name] = build_schema(name)
    return JSONResponse(_BUILT[name])
