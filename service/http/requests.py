"""Parse and validate OpenAI-style request bodies into typed requests; bad input -> ApiError 4xx."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from cachestore.jsondepth import MAX_JSON_DEPTH, nesting_depth
from cachestore.keys import SESSION_ID_PATTERN, SESSION_ID_RULE
from service.engines import GenParams
from service.http.errors import ApiError, bad_request
from service.http.params import (
    ToolSpec,
    check_keys,
    check_stream,
    check_stream_tools,
    parse_params,
    parse_tools,
    with_tools,
)

SESSION_ID_RE = re.compile(SESSION_ID_PATTERN)
ROLES = ("system", "user", "assistant", "tool", "developer")  # the one list (validation and OpenAPI)
MAX_MESSAGES = 1024
MAX_TOOL_CALLS = 64
DRAIN_MAX_BYTES = 32 << 20  # of a body over the limit, read (and dropped) at most this much so the client sees 413


@dataclass(frozen=True)
class CompletionRequest:
    """A validated chat or text completion request."""

    model: str
    messages: list[dict[str, Any]] | None  # chat: the conversation; text: None
    prompt: str | None
    params: GenParams
    stream: bool
    include_usage: bool
    session_id: str | None
    prompt_ids: list[int] | None = None  # text completions: a prompt of token ids, as OpenAI's API takes
    return_token_ids: bool = False  # vLLM's extension: the body carries the prompt's and the reply's token ids
    tools: ToolSpec | None = None  # chat: the tools offered (rendered, and the reply parsed for calls)


MAX_PROMPT_IDS = 1 << 17


def _token_ids(raw: list[Any]) -> list[int] | None:
    """A prompt given as token ids ([1, 2, 3] or [[1, 2, 3]]), or None if it is not one."""
    if len(raw) == 1 and isinstance(raw[0], list):
        raw = raw[0]
    if not raw or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        return None
    if len(raw) > MAX_PROMPT_IDS or min(raw) < 0 or max(raw) >= 2**31:
        raise bad_request(f"a token-id prompt holds 1..{MAX_PROMPT_IDS} ids in [0, 2**31)", param="prompt")
    return [int(t) for t in raw]


async def _drain(stream: AsyncIterator[bytes], max_bytes: int, timeout_s: float) -> None:
    """Read and drop what is left of a refused body, at most `max_bytes` and `timeout_s`. A client that sends its
    whole body before reading (urllib, requests) then reads the 413; closing on unread bytes resets the connection
    and the client sees "connection reset by peer" instead."""

    async def consume() -> None:
        size = 0
        async for chunk in stream:
            size += len(chunk)
            if size > max_bytes:
                return

    try:
        await asyncio.wait_for(consume(), timeout_s)
    except TimeoutError:
        pass


async def _read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The raw body, refused past `max_bytes` (413) or when it takes longer than `timeout_s` to arrive (408)."""
    too_large = ApiError(413, f"request body is larger than {max_bytes} bytes", code="body_too_large",
                         headers={"Connection": "close"})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    stream = request.stream()
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        if int(declared) <= DRAIN_MAX_BYTES:
            await _drain(stream, DRAIN_MAX_BYTES, timeout_s)
        raise too_large

    async def collect() -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        async for chunk in stream:
            size += len(chunk)
            if size > max_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        body = await asyncio.wait_for(collect(), timeout_s)
    except TimeoutError:  # a slow (slowloris-style) body must not hold an admission slot or a buffer forever
        raise ApiError(408, f"request body did not arrive within {timeout_s:g} s", code="body_timeout",
                       headers={"Connection": "close"}) from None
    if body is None:
        await _drain(stream, DRAIN_MAX_BYTES, max(0.0, deadline - loop.time()))
        raise too_large
    return body


async def read_json(request: Request, max_bytes: int, timeout_s: float = 10.0,
                    optional: bool = False) -> dict[str, Any]:
    """The body as a JSON object, bounded in size, time and depth, as valid UTF-8; `optional`: empty -> {}."""
    raw = await _read_body(request, max_bytes, timeout_s)
    if not raw.strip():
        if optional:
            return {}
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("request body is not valid UTF-8", code="invalid_json") from None
    if nesting_depth(raw) > MAX_JSON_DEPTH:  # before parsing: the parser recurses once a level
        raise bad_request(f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        raise bad_request("request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return body


def check_session_id(value: Any, param: str = "session_id") -> str:
    if not isinstance(value, str) or not SESSION_ID_RE.match(value):
        raise bad_request(f"invalid session id: {SESSION_ID_RULE}", param=param, code="invalid_session_id")
    return value


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"{where}: only text content parts are supported", param=where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where}.content must be a string or a list of text parts", param=where)


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, in OpenAI's shape (arguments a string)."""
    if not isinstance(value, list) or not value or len(value) > MAX_TOOL_CALLS:
        raise bad_request(f"{where}.tool_calls must be an array of 1..{MAX_TOOL_CALLS} calls", param=where)
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]
                and isinstance(fn.get("arguments", ""), str) and call.get("type", "function") == "function"):
            raise bad_request(f"{where}.tool_calls[{j}] must be {{\"type\": \"function\", \"id\": ..., "
                              "\"function\": {\"name\": ..., \"arguments\": \"<JSON text>\"}}", param=where)
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise bad_request(f"{where}.tool_calls[{j}].id must be a string", param=where)
        calls.append({"id": call_id, "type": "function",
                      "function": {"name": fn["name"], "arguments": fn.get("arguments", "")}})
    return calls


def parse_message(msg: Any, where: str) -> dict[str, Any]:
    """One message: role and text content; an assistant's `tool_calls` (content may then be null), a tool
    result's `tool_call_id`, a `name`. Any other key is refused by name."""
    if not isinstance(msg, dict):
        raise bad_request(f"{where} must be an object", param=where)
    role = msg.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {list(ROLES)}", param=where)
    extra = set(msg) - {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}
    if extra:
        raise bad_request(f"{where}: unknown message field {sorted(extra)[0]!r}", param=where,
                          code="unknown_parameter")
    out: dict[str, Any] = {"role": role}
    if role == "assistant" and msg.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(msg["tool_calls"], where)
        out["content"] = None if msg.get("content") is None else _text_content(msg["content"], where)
    else:
        out["content"] = _text_content(msg.get("content"), where)
    if msg.get("refusal") is not None and role != "assistant":
        raise bad_request(f"{where}.refusal belongs to assistant messages", param=where)
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"{where}.tool_call_id is required for a tool message", param=where)
        out["tool_call_id"] = call_id
    if msg.get("name") is not None:
        if not isinstance(msg["name"], str):
            raise bad_request(f"{where}.name must be a string", param=where)
        out["name"] = msg["name"]
    return out


def parse_messages(value: Any, param: str = "messages", allow_empty: bool = False) -> list[dict[str, Any]]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise bad_request(f"{param} must be a non-empty array of messages", param=param)
    if len(value) > MAX_MESSAGES:
        raise bad_request(f"{param} holds more than {MAX_MESSAGES} messages", param=param)
    return [parse_message(msg, f"{param}[{i}]") for i, msg in enumerate(value)]


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", param="stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request("stream_options.include_usage must be a boolean", param="stream_options")
    other = set(options) - {"include_usage", "include_obfuscation"}
    if other or options.get("include_obfuscation"):
        raise bad_request(f"stream_options: only include_usage is supported (got {sorted(other or options)})",
                          param="stream_options", code="unsupported_parameter")
    return stream, include_usage


def parse_completion(
    body: dict[str, Any], *, chat: bool, header_session: str | None, max_tokens_limit: int, default_max_tokens: int
) -> CompletionRequest:
    check_keys(body, chat)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required and must be a string", param="model")
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    if chat:
        messages = parse_messages(body.get("messages"))
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
            raw = raw[0]
        if isinstance(raw, list):
            prompt_ids = _token_ids(raw)
        if prompt_ids is None and (not isinstance(raw, str) or not raw):
            raise bad_request("prompt must be a non-empty string or an array of token ids", param="prompt")
        prompt = raw if isinstance(raw, str) else None
    session = body.get("session_id", header_session)
    stream, include_usage = stream_flags(body)
    params = parse_params(body, max_tokens_limit, default_max_tokens, chat=chat)
    check_stream(params, stream)
    tools = parse_tools(body) if chat else None
    check_stream_tools(tools, stream)
    params = with_tools(params, tools)
    return CompletionRequest(
        model=model,
        messages=messages,
        prompt=prompt,
        params=params,
        stream=stream,
        include_usage=include_usage,
        session_id=None if session is None else check_session_id(session),
        prompt_ids=prompt_ids,
        return_token_ids=parse_flag(body, "return_token_ids"),
        tools=tools,
    )


def parse_flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean", param=name)
    return value
